"""Byte-level BPE tokenizer trained with HF ``tokenizers``, cached by content hash."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from workloads.core.atomic import atomic_path
from workloads.lm.data.sources import Document

EOT = "<|endoftext|>"
_TOKENIZER_VERSION = "bytelevel-bpe-v1"  # bump when the training recipe changes


def fold_document(h: hashlib._Hash, doc_id: str, text_digest: bytes) -> None:
    """Add one document (its id and the sha256 digest of its text) to the running hash ``h``."""
    h.update(doc_id.encode())
    h.update(b"\0")
    h.update(text_digest)


def documents_fingerprint(docs: Iterable[Document]) -> str:
    """sha256 over the ids and texts of ``docs`` (order-sensitive), hex."""
    h = hashlib.sha256()
    for doc in docs:
        fold_document(h, doc.doc_id, hashlib.sha256(doc.text.encode()).digest())
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
    with atomic_path(path) as tmp:
        tok.save(str(tmp))
    return tok, path


def pretrained_tokenizer(name: str, cache_dir: str | os.PathLike) -> tuple[Tokenizer, Path]:
    """The pretrained Hugging Face tokenizer ``name``: a local directory holding its
    ``tokenizer.json`` (read where it is), or a hub name (e.g. the paper's Llama tokenizer,
    ``hf-internal-testing/llama-tokenizer``) fetched once and cached as a JSON file under
    ``cache_dir``.

    Raises:
        RuntimeError: a directory without ``tokenizer.json``; a hub name not cached while the
            hub cannot be reached.
    """
    if Path(name).is_dir():
        path = Path(name) / "tokenizer.json"
        if not path.is_file():
            raise RuntimeError(f"tokenizer directory {name} has no tokenizer.json")
        return Tokenizer.from_file(str(path)), path
    path = Path(cache_dir) / f"tokenizer-{name.replace('/', '--')}.json"
    if path.exists():
        return Tokenizer.from_file(str(path)), path
    try:
        tok = Tokenizer.from_pretrained(name)
    except Exception as e:  # tokenizers raises a bare Exception for hub errors
        raise RuntimeError(f"could not fetch tokenizer {name!r}: {e}") from None
    with atomic_path(path) as tmp:
        tok.save(str(tmp))
    return tok, path


def end_of_text_id(tok: Tokenizer) -> int:
    """Id of the document separator: ``EOT`` for our BPE, ``</s>`` (Llama) or ``<eos>``.

    Raises:
        ValueError: the tokenizer has none of them.
    """
    for token in (EOT, "</s>", "<eos>"):
        token_id = tok.token_to_id(token)
        if token_id is not None:
            return token_id
    raise ValueError(f"the tokenizer has no end-of-text token ({EOT}, </s> or <eos>)")
