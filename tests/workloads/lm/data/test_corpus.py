"""Corpus preparation: tokenizer on the train split only, token shards, cache, unigram floor,
the same bytes in process and on Ray Data with 1 or 4 tasks (a small local corpus in process
even on Ray), SlimPajama's schema offline."""

import json
import logging
import math
import os
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError
from tokenizers import Tokenizer

from tests.conftest import RAY_CLUSTER, write_corpus
from workloads.lm.data import (
    CorpusConfig,
    TextFilesSource,
    documents,
    prepare_corpus,
    split_documents,
)
from workloads.lm.data.packing import token_dtype
from workloads.lm.data.pipeline import IN_PROCESS_BYTES, scan
from workloads.lm.data.sources import SlimPajamaSource
from workloads.lm.data.tokenizer import train_tokenizer


def stream_of(corpus, split: str) -> np.ndarray:
    """The split's whole token stream: its shards, concatenated."""
    dtype = token_dtype(corpus.vocab_size)
    return np.concatenate([np.fromfile(p, dtype=dtype) for p in corpus.paths(split)])


def texts_by_split(corpus, docs: dict[str, str]) -> dict[str, list[str]]:
    """Each split's documents decoded back from its stream (EOT-separated), in order."""
    tok = Tokenizer.from_file(corpus.tokenizer_path)
    out = {}
    for split in ("train", "validation", "test"):
        stream = stream_of(corpus, split)
        assert len(stream) == corpus.n_tokens[split] and stream[-1] == corpus.eot_id
        pieces = np.split(stream, np.flatnonzero(stream == corpus.eot_id) + 1)[:-1]
        out[split] = [tok.decode(p[:-1].tolist()) for p in pieces]
    return out


def test_prepare_corpus_splits_tokenizes_and_caches(corpus_glob, tmp_path):
    cfg = CorpusConfig(source="text_files", paths=corpus_glob, vocab_size=300,
                       val_fraction=0.1, test_fraction=0.1)
    corpus = prepare_corpus(cfg, tmp_path / "cache")
    assert corpus.n_documents == {"train": 8, "validation": 2, "test": 2}  # ceil(1.2) = 2
    tok = Tokenizer.from_file(corpus.tokenizer_path)
    assert tok.get_vocab_size() == corpus.vocab_size == 300

    docs = {d.doc_id: d.text for d in documents(TextFilesSource(corpus_glob))}
    splits = split_documents(sorted(docs), 0.1, 0.1, 0)
    # Documents joined by EOT, one EOT after each, and nothing lost in the round trip.
    assert texts_by_split(corpus, docs) == {
        split: [docs[d] for d in sorted(docs) if splits[d] == split]
        for split in ("train", "validation", "test")}

    # Cache hit: same manifest, no retraining (the tokenizer file is not rewritten).
    mtime = os.path.getmtime(corpus.tokenizer_path)
    assert prepare_corpus(cfg, tmp_path / "cache") == corpus
    assert os.path.getmtime(corpus.tokenizer_path) == mtime


def test_tokenizer_is_trained_on_the_train_split_only(tmp_path):
    pattern = write_corpus(tmp_path / "c", n_docs=10, words_per_doc=2000)
    cfg = CorpusConfig(source="text_files", paths=pattern, vocab_size=400, val_fraction=0.1,
                       test_fraction=0.1)
    source = TextFilesSource(pattern)
    splits = split_documents([source.doc_id(p) for p in source.paths], 0.1, 0.1, 0)
    test_doc = next(d for d, s in splits.items() if s == "test")
    with open(tmp_path / "c" / test_doc, "a") as f:
        f.write(" zyxwvutsrq" * 500)  # frequent, but only in a test document
    tok = Tokenizer.from_file(prepare_corpus(cfg, tmp_path / "cache").tokenizer_path)
    assert len(tok.encode(" zyxwvutsrq").ids) > 3
    assert len(tok.encode(" king").ids) == 1  # frequent in train: merged into one token


def test_unigram_perplexity_against_its_definition(corpus_glob, tmp_path):
    cfg = CorpusConfig(source="text_files", paths=corpus_glob, vocab_size=300,
                       val_fraction=0.1, test_fraction=0.1)
    corpus = prepare_corpus(cfg, tmp_path / "cache")
    train = Counter(stream_of(corpus, "train").tolist())
    test = stream_of(corpus, "test").tolist()
    total = sum(train.values()) + 300
    nll = -sum(math.log((train[t] + 1) / total) for t in test) / len(test)
    assert corpus.unigram_test_perplexity == pytest.approx(math.exp(nll), rel=1e-9)


def shard_bytes(corpus) -> dict[str, bytes]:
    files = [n for names in corpus.shards.values() for n in names] + ["tokenizer.json"]
    return {n: (Path(corpus.directory) / n).read_bytes() for n in files}


def _pids(batch: dict) -> dict:
    """The id of the process that ran the batch, once per document."""
    return {"pid": np.full(len(batch["doc_id"]), os.getpid())}


def test_a_pass_runs_in_process_where_ray_is_not_installed(tmp_path, monkeypatch):
    """A GPU machine with torch alone (``python -m workloads.runtime.worker``) prepares its corpus
    here, even when a task count is asked for."""
    monkeypatch.setitem(sys.modules, "ray", None)  # ``import ray`` raises ModuleNotFoundError
    source = TextFilesSource(write_corpus(tmp_path / "c", n_docs=3, words_per_doc=100))
    assert set(np.concatenate([b["pid"] for b in scan(source, _pids, tasks=2)])) == {
        os.getpid()}


@pytest.mark.slow
@RAY_CLUSTER
def test_ray_data_with_1_or_4_tasks_writes_the_bytes_written_in_process(tmp_path):
    import ray

    pattern = write_corpus(tmp_path / "c", n_docs=40, words_per_doc=1500)
    cfg = CorpusConfig(source="text_files", paths=pattern, vocab_size=350)
    local = prepare_corpus(cfg, tmp_path / "local", shard_tokens=4096)  # no Ray: in process
    source = TextFilesSource(pattern)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        one = prepare_corpus(cfg, tmp_path / "one", tasks=1, shard_tokens=4096)
        four = prepare_corpus(cfg, tmp_path / "four", tasks=4, shard_tokens=4096)
        # Without a task count, a source this small (under IN_PROCESS_BYTES) runs here.
        auto = prepare_corpus(cfg, tmp_path / "auto", shard_tokens=4096)
        here = np.concatenate([b["pid"] for b in scan(source, _pids)])
        on_ray = np.concatenate([b["pid"] for b in scan(source, _pids, tasks=1)])
    finally:
        ray.shutdown()
    assert 0 < source.local_bytes() <= IN_PROCESS_BYTES
    assert len(here) == len(on_ray) == 40
    assert set(here) == {os.getpid()} and os.getpid() not in set(on_ray)
    assert shard_bytes(auto) == shard_bytes(local)
    assert len(local.shards["train"]) > 5  # several shards, several parts (8 files each)
    expected = shard_bytes(local)
    assert shard_bytes(one) == expected and shard_bytes(four) == expected
    fields = {"directory"}
    assert one.model_dump(exclude=fields) == four.model_dump(exclude=fields) \
        == local.model_dump(exclude=fields)


def test_slimpajama_schema_offline_with_a_local_tokenizer_directory(tmp_path):
    # A local dataset with SlimPajama's schema, read by the same `datasets` streaming code.
    rows = [{"text": f"row {i}: " + "the king and the queen spoke of the sea. " * (i % 7 + 1),
             "meta": {"redpajama_set_name": "RedPajamaC4"}} for i in range(50)]
    (tmp_path / "sp").mkdir()
    for shard in range(2):
        with open(tmp_path / "sp" / f"part-{shard}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows[25 * shard: 25 * shard + 25])
    tokenizer, _ = train_tokenizer([], 300, tmp_path / "tok-cache")  # bytes + EOT only
    (tmp_path / "tok").mkdir()
    tokenizer.save(str(tmp_path / "tok" / "tokenizer.json"))

    cfg = CorpusConfig(source="slimpajama", dataset=str(tmp_path / "sp"), max_documents=40,
                       tokenizer=str(tmp_path / "tok"), val_fraction=0.1, test_fraction=0.1)
    corpus = prepare_corpus(cfg, tmp_path / "cache")
    ids = [f"{i:09d}" for i in range(40)]  # the first 40 rows, by stream position
    splits = split_documents(ids, 0.1, 0.1)
    assert corpus.n_documents == {"train": 32, "validation": 4, "test": 4}
    assert Path(corpus.tokenizer_path).read_bytes() == (tmp_path / "tok" / "tokenizer.json"
                                                        ).read_bytes()
    docs = {d: rows[i]["text"] for i, d in enumerate(ids)}
    assert texts_by_split(corpus, docs) == {
        split: [docs[d] for d in ids if splits[d] == split]
        for split in ("train", "validation", "test")}


def test_a_tokenizer_directory_without_tokenizer_json_is_refused_by_the_config(corpus_glob,
                                                                             tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValidationError, match="has no tokenizer.json"):
        CorpusConfig(source="text_files", paths=corpus_glob, tokenizer=str(tmp_path / "empty"))


def test_corrupt_slimpajama_rows_are_skipped_and_counted(tmp_path, caplog):
    rows = [{"text": f"row {i}: the king and the queen spoke of the sea."} for i in range(12)]
    rows[3], rows[5], rows[8] = {"text": None}, {"meta": {}}, {"text": 17}
    (tmp_path / "sp").mkdir()
    with open(tmp_path / "sp" / "part-0.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    source = SlimPajamaSource(str(tmp_path / "sp"), max_documents=10)
    with caplog.at_level(logging.WARNING):
        docs = list(documents(source))
    assert [d.doc_id for d in docs] == [f"{i:09d}" for i in range(10) if i not in (3, 5, 8)]
    assert [d.text for d in docs] == [rows[i]["text"] for i in range(10) if i not in (3, 5, 8)]
    assert "skipped 3 of the first 10 rows" in caplog.text
