"""Benchmark of the corpus pipeline on SlimPajama-shaped corpora (not a test; prints numbers).

``python -m workloads.lm.data.corpus_bench [--docs 10000 100000 1000000] [--dir DIR]``

For each size: generate (once, cached under ``DIR``) a local dataset with SlimPajama's schema
(``text``, ``meta.redpajama_set_name``; JSONL files of 10k rows) whose document lengths follow
a log-normal distribution (median 250 words, mean ~770, SlimPajama's ~1k tokens per document);
then prepare it, in a fresh process on a fresh local Ray instance, through the same path a spec
with ``source: slimpajama`` takes, with a 32k byte-level BPE saved as a local tokenizer
directory. Prints, per size: documents, tokens, wall seconds, tokens/s (total and per core),
the driver's and the Ray workers' peak RSS (sampled ``VmRSS``, and its private ``RssAnon``),
and the shards' bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from multiprocessing import Pool
from pathlib import Path

import numpy as np

ROWS_PER_FILE = 10_000
_SETS = ("RedPajamaCommonCrawl", "RedPajamaC4", "RedPajamaGithub", "RedPajamaBook",
         "RedPajamaArXiv", "RedPajamaWikipedia", "RedPajamaStackExchange")
_SET_WEIGHTS = (0.52, 0.27, 0.05, 0.04, 0.05, 0.04, 0.03)  # SlimPajama's token shares


def _vocabulary(rng: np.random.Generator, n_words: int = 20_000) -> np.ndarray:
    syllables = np.array([c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"])
    lengths = rng.integers(1, 4, n_words)
    return np.array(["".join(rng.choice(syllables, k)) for k in lengths])


def _write_file(args: tuple[Path, int, int]) -> None:
    path, start, n_rows = args
    rng = np.random.default_rng(start)
    words = _vocabulary(np.random.default_rng(0))  # one vocabulary for the whole corpus
    cdf = np.cumsum(1.0 / np.arange(1, len(words) + 1))  # Zipf's law over the words
    cdf /= cdf[-1]
    lengths = np.minimum(rng.lognormal(np.log(250), 1.5, n_rows).astype(int) + 1, 100_000)
    sets = rng.choice(len(_SETS), n_rows, p=_SET_WEIGHTS)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        for length, which in zip(lengths, sets):
            text = " ".join(words[np.searchsorted(cdf, rng.random(length))])
            f.write(json.dumps({"text": text,
                                "meta": {"redpajama_set_name": _SETS[which]}}) + "\n")
    tmp.rename(path)


def generate(directory: Path, n_docs: int) -> Path:
    """A SlimPajama-schema JSONL dataset of ``n_docs`` rows under ``directory/sp-<n>`` (files
    written whole, then renamed; existing files are kept)."""
    out = directory / f"sp-{n_docs}"
    out.mkdir(parents=True, exist_ok=True)
    todo = [(out / f"part-{i:05d}.jsonl", start, min(ROWS_PER_FILE, n_docs - start))
            for i, start in enumerate(range(0, n_docs, ROWS_PER_FILE))]
    todo = [t for t in todo if not t[0].exists()]
    if todo:
        with Pool(os.cpu_count()) as pool:
            pool.map(_write_file, todo)
    return out


def tokenizer_dir(directory: Path, dataset: Path) -> Path:
    """A 32000-entry byte-level BPE trained on the first 16 MiB of ``dataset``, saved as a
    local tokenizer directory (once)."""
    from workloads.lm.data.sources import SlimPajamaSource, documents
    from workloads.lm.data.tokenizer import train_tokenizer

    out = directory / "tokenizer-32k"
    if not (out / "tokenizer.json").exists():
        sample, size = [], 0
        for doc in documents(SlimPajamaSource(str(dataset), 10**9)):
            sample.append(doc)
            size += len(doc.text)
            if size > 2**24:
                break
        tok, _ = train_tokenizer(sample, 32_000, directory / "cache")
        out.mkdir(exist_ok=True)
        tok.save(str(out / "tokenizer.json"))
    return out


class MemorySampler(threading.Thread):
    """Samples, every ``interval`` s, the RSS (``VmRSS``) and its private part (``RssAnon``;
    the rest is shared: libraries, Ray object-store pages) of this process and of every Ray
    worker process (``ray::...``); keeps the peaks, in bytes."""

    def __init__(self, interval: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.interval, self.peaks = interval, {"driver": (0, 0), "workers": (0, 0)}
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(self.interval):
            self._keep("driver", [_rss("self")])
            self._keep("workers", [_rss(p.name) for p in Path("/proc").iterdir()
                                   if p.name.isdigit() and _is_ray_worker(p)])

    def stop(self) -> dict[str, tuple[int, int]]:
        self._done.set()
        self.join()
        return self.peaks

    def _keep(self, who: str, samples: list[tuple[int, int]]) -> None:
        rss, anon = self.peaks[who]
        self.peaks[who] = (max([rss] + [s[0] for s in samples]),
                           max([anon] + [s[1] for s in samples]))


def _is_ray_worker(proc: Path) -> bool:
    try:
        return (proc / "cmdline").read_bytes().startswith(b"ray::")
    except OSError:
        return False


def _rss(pid: str) -> tuple[int, int]:
    """``(VmRSS, RssAnon)`` of process ``pid`` in bytes (zeros if it is gone)."""
    fields = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon"):
                fields[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return fields.get("VmRSS", 0), fields.get("RssAnon", 0)


def measure(dataset: Path, n_docs: int, tokenizer: Path, cache: Path) -> dict:
    """Prepare ``dataset`` on a fresh local Ray instance in this process; the numbers."""
    import ray

    from workloads.lm.data.corpus import CorpusConfig, prepare_corpus

    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    cores = int(ray.cluster_resources()["CPU"])
    cfg = CorpusConfig(source="slimpajama", dataset=str(dataset), max_documents=n_docs,
                       tokenizer=str(tokenizer))
    sampler = MemorySampler()
    sampler.start()
    started = time.perf_counter()
    corpus = prepare_corpus(cfg, cache)
    wall = time.perf_counter() - started
    peaks = sampler.stop()
    ray.shutdown()
    tokens = sum(corpus.n_tokens.values())
    shard_bytes = sum(os.path.getsize(p) for s in corpus.shards for p in corpus.paths(s))
    shutil.rmtree(cache)
    return {"docs": n_docs, "tokens": tokens, "wall_s": wall, "cores": cores,
            "tokens_per_s": tokens / wall, "tokens_per_s_per_core": tokens / wall / cores,
            "driver_peak_rss": peaks["driver"], "worker_peak_rss": peaks["workers"],
            "shard_bytes": shard_bytes, "shards": sum(len(v) for v in corpus.shards.values())}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--dir", type=Path, default=Path(os.environ.get(
        "CEMLAB_HOME", ".cemlab")) / "data-bench")
    parser.add_argument("--measure", type=int, help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args(argv)
    if args.measure:
        dataset = args.dir / f"sp-{args.measure}"
        print(json.dumps(measure(dataset, args.measure, args.dir / "tokenizer-32k",
                                 args.dir / f"cache-{time.time_ns()}")))
        return
    rows = []
    for n in args.docs:
        print(f"generating {n} SlimPajama-shaped documents in {args.dir} ...", flush=True)
        tokenizer_dir(args.dir, generate(args.dir, n))
        child = subprocess.run([sys.executable, "-m", "workloads.lm.data.corpus_bench", "--dir",
                                str(args.dir), "--measure", str(n)], check=True,
                               stdout=subprocess.PIPE, text=True)
        rows.append(json.loads(child.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        print(f"  {r['tokens']:,} tokens in {r['wall_s']:.1f} s", flush=True)
    mib = 2**20
    print("\nPeak RSS in MiB, as total (private): the rest is shared (libraries, object store)."
          "\n\n| documents | tokens | wall s | tokens/s | tokens/s/core | driver peak RSS | "
          "worker peak RSS | shards |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        (d_rss, d_anon), (w_rss, w_anon) = r["driver_peak_rss"], r["worker_peak_rss"]
        print(f"| {r['docs']:,} | {r['tokens']:,} | {r['wall_s']:.1f} | "
              f"{r['tokens_per_s'] / 1e6:.2f} M | {r['tokens_per_s_per_core'] / 1e6:.2f} M "
              f"({r['cores']} cores) | {d_rss / mib:.0f} ({d_anon / mib:.0f}) | "
              f"{w_rss / mib:.0f} ({w_anon / mib:.0f}) | {r['shards']} files, "
              f"{r['shard_bytes'] / mib:.0f} MiB |")


if __name__ == "__main__":
    main()
