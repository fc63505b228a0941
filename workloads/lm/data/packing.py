"""Token streams on disk and fixed-length packed sequences over them (paper App. C.2).

Documents are tokenized, each followed by the end-of-text token, and concatenated into one flat
stream, stored as fixed-size shards of raw little-endian integers. Training sequences are
consecutive windows of that stream: no padding, documents may straddle sequence boundaries.
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from workloads.core.atomic import atomic_path


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype holding ids below ``vocab_size``."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


class ShardWriter:
    """Appends token arrays into fixed-size shards ``<prefix>-00000.bin``, ... under
    ``directory``: every shard but the last holds exactly ``shard_tokens`` tokens, so the bytes
    depend only on the concatenated stream, never on how it was cut into ``write`` calls. Tokens
    go straight to the open shard's temporary file, renamed into place when the shard is full
    (or at ``close``); leaving the ``with`` block on an exception removes it. Also counts every
    token id (``counts``: shape (vocab_size,), int64), the histogram the unigram floor needs.
    Memory: the histogram only.
    """

    def __init__(self, directory: str | os.PathLike, prefix: str, vocab_size: int,
                 shard_tokens: int) -> None:
        self.directory, self.prefix, self.shard_tokens = Path(directory), prefix, shard_tokens
        self.dtype = token_dtype(vocab_size)
        self.counts = np.zeros(vocab_size, dtype=np.int64)
        self.names: list[str] = []
        self.n_tokens = 0
        self._shard: ExitStack | None = None  # the open shard: its file and atomic_path
        self._file: BinaryIO | None = None
        self._in_shard = 0

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._shard is not None:
            self._shard.__exit__(*exc)  # on an exception: the partial shard is removed

    def write(self, tokens: np.ndarray) -> None:
        """Append ``tokens`` (shape (n,), ids below ``vocab_size``)."""
        self.counts += np.bincount(tokens, minlength=len(self.counts))
        self.n_tokens += tokens.size
        tokens = tokens.astype(self.dtype, copy=False)
        while tokens.size:
            if self._file is None:
                self._shard = ExitStack()
                tmp = self._shard.enter_context(atomic_path(
                    self.directory / f"{self.prefix}-{len(self.names):05d}.bin"))
                self._file = self._shard.enter_context(open(tmp, "wb"))
            take = min(tokens.size, self.shard_tokens - self._in_shard)
            self._file.write(tokens[:take].tobytes())
            self._in_shard += take
            tokens = tokens[take:]
            if self._in_shard == self.shard_tokens:
                self._finish_shard()

    def close(self) -> list[str]:
        """Finish the last (shorter) shard; the shard file names, in stream order."""
        if self._file is not None:
            self._finish_shard()
        return self.names

    def _finish_shard(self) -> None:
        self._shard.close()  # closes the file, renames it into place
        self.names.append(f"{self.prefix}-{len(self.names):05d}.bin")
        self._shard, self._file, self._in_shard = None, None, 0


def read_token_stream(path: str | os.PathLike, vocab_size: int) -> np.memmap:
    """The token stream at ``path`` as a read-only memory map of shape (n_tokens,)."""
    return np.memmap(path, dtype=token_dtype(vocab_size), mode="r")


class PackedSequences(torch.utils.data.Dataset):
    """Consecutive fixed-length windows of a token stream stored as shards (memory-mapped).

    The stream is the concatenation of the shard files at ``paths``, in order. Item i is
    ``(x, y)``, two LongTensors of shape (seq_len,): ``x = stream[i*L : i*L + L]`` and the
    next-token targets ``y = stream[i*L + 1 : i*L + L + 1]``; a window may span two shards.
    There are ``(n_tokens - 1) // seq_len`` items; the tail shorter than a window is dropped.

    Raises:
        ValueError: the stream is shorter than one window.
    """

    def __init__(self, paths: list[str | os.PathLike], vocab_size: int, seq_len: int) -> None:
        self.paths, self.vocab_size, self.seq_len = [str(p) for p in paths], vocab_size, seq_len
        itemsize = token_dtype(vocab_size).itemsize
        sizes = [os.path.getsize(p) // itemsize for p in self.paths]
        self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.n_tokens = int(self.starts[-1])
        if len(self) == 0:
            raise ValueError(f"{self.paths[0] if self.paths else 'no shard'}: {self.n_tokens} "
                             f"tokens, fewer than one sequence of {seq_len} + 1")
        self._shards: list[np.memmap] | None = None  # opened lazily: picklable into workers

    def __len__(self) -> int:
        return (self.n_tokens - 1) // self.seq_len

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """``stream[start:stop]`` (0 <= start <= stop <= n_tokens), gathered across shards."""
        if self._shards is None:
            self._shards = [read_token_stream(p, self.vocab_size) for p in self.paths]
        pieces, shard = [], int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < stop:
            offset = start - self.starts[shard]
            piece = self._shards[shard][offset:offset + stop - start]
            pieces.append(piece)
            start += len(piece)
            shard += 1
        return np.concatenate(pieces) if len(pieces) != 1 else pieces[0]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = torch.from_numpy(
            self.tokens(i * self.seq_len, (i + 1) * self.seq_len + 1).astype(np.int64))
        return window[:-1], window[1:]
