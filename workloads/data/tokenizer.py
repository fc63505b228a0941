"""Byte-level BPE tokenizer trained with HF ``tokenizers``, cached by content hash."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from workloads.data.sources import Document

EOT = "<|endoftext|>"
_TOKENIZER_VERSION = "bytelevel-bpe-v1"  # bump when the training recipe changes


def documents_fingerprint(docs: Iterable[Document]) -> str:
    """sha256 over the ids and texts of ``docs`` (order-sensitive), hex."""
    h = hashlib.sha256()
    for doc in docs:
        h.update(doc.doc_id.encode())
        h.update(b"\0")
        h.update(hashlib.sha256(doc.text.encode()).digest())
    return h.hexdigest()


def train_tokenizer(train_docs: list[Document], vocab_size: int, cache_dir: str | os.PathLike,
                    ) -> tuple[Tokenizer, Path]:
    """A byte-level BPE with ``vocab_size`` entries (``EOT`` included) trained on ``train_docs``.

    Cached under ``cache_dir/tokenizer-<hash>.json``, the hash covering the training documents,
    the vocabulary size and the recipe; a cache hit loads instead of training. The file is written
    atomically (temporary file, then rename).

    Returns:
        The tokenizer and the path of its JSON file.
    """
    key = hashlib.sha256(f"{_TOKENIZER_VERSION}:{vocab_size}:"
                         f"{documents_fingerprint(train_docs)}".encode()).hexdigest()[:16]
    path = Path(cache_dir) / f"tokenizer-{key}.json"
    if path.exists():
        return Tokenizer.from_file(str(path)), path
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator((d.text for d in train_docs), trainer=trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tok.save(str(tmp))
    os.replace(tmp, path)
    return tok, path
