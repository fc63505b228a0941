"""Token streams on disk and fixed-length packed sequences over them (paper App. C.2).

Documents are tokenized, each followed by the end-of-text token, and concatenated into one flat
stream stored as raw little-endian integers. Training sequences are consecutive windows of that
stream: no padding, documents may straddle sequence boundaries.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator

import numpy as np
import torch
from tokenizers import Tokenizer

from workloads.atomic import atomic_path
from workloads.data.sources import Document


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype holding ids below ``vocab_size``."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def _batches(docs: Iterable[Document], size: int) -> Iterator[list[Document]]:
    batch: list[Document] = []
    for doc in docs:
        batch.append(doc)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def write_token_stream(tokenizer: Tokenizer, docs: Iterable[Document], eot_id: int,
                       path: str | os.PathLike, batch_docs: int = 64) -> int:
    """Tokenize ``docs`` into the flat stream ``doc_1 EOT doc_2 EOT ...`` at ``path``.

    Streams batch by batch (memory bounded by ``batch_docs`` documents) into a temporary file
    that is renamed into place when complete, so ``path`` is never half-written.

    Returns:
        The number of tokens written.
    """
    dtype = token_dtype(tokenizer.get_vocab_size())
    n_tokens = 0
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        for batch in _batches(docs, batch_docs):
            for enc in tokenizer.encode_batch([d.text for d in batch]):
                ids = np.asarray(enc.ids + [eot_id], dtype=dtype)
                f.write(ids.tobytes())
                n_tokens += ids.size
    return n_tokens


def read_token_stream(path: str | os.PathLike, vocab_size: int) -> np.memmap:
    """The token stream at ``path`` as a read-only memory map of shape (n_tokens,)."""
    return np.memmap(path, dtype=token_dtype(vocab_size), mode="r")


class PackedSequences(torch.utils.data.Dataset):
    """Consecutive fixed-length windows of a token stream.

    Item i is ``(x, y)``, two LongTensors of shape (seq_len,): ``x = stream[i*L : i*L + L]`` and
    the next-token targets ``y = stream[i*L + 1 : i*L + L + 1]``. There are
    ``(n_tokens - 1) // seq_len`` items; the tail shorter than a window is dropped.

    Raises:
        ValueError: the stream is shorter than one window.
    """

    def __init__(self, path: str | os.PathLike, vocab_size: int, seq_len: int) -> None:
        self.path, self.vocab_size, self.seq_len = str(path), vocab_size, seq_len
        self.n_tokens = len(read_token_stream(path, vocab_size))
        if len(self) == 0:
            raise ValueError(f"{path}: {self.n_tokens} tokens, fewer than one sequence of "
                             f"{seq_len} + 1")
        self._stream: np.memmap | None = None  # opened lazily: picklable into loader workers

    def __len__(self) -> int:
        return (self.n_tokens - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._stream is None:
            self._stream = read_token_stream(self.path, self.vocab_size)
        window = torch.from_numpy(
            self._stream[i * self.seq_len: (i + 1) * self.seq_len + 1].astype(np.int64))
        return window[:-1], window[1:]
