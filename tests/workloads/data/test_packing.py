"""Packed sequences: consecutive windows of a token stream."""

import numpy as np
import pytest
import torch

from workloads.data import PackedSequences


def test_packed_sequences_are_consecutive_windows_without_padding(tmp_path):
    path = tmp_path / "s.bin"
    stream = np.arange(103, dtype=np.uint16)
    stream.tofile(path)
    ds = PackedSequences(path, vocab_size=1000, seq_len=10)
    assert len(ds) == 10  # (103 - 1) // 10
    for i in range(len(ds)):
        x, y = ds[i]
        assert x.dtype == torch.int64 and x.shape == y.shape == (10,)
        assert x.tolist() == list(range(10 * i, 10 * i + 10))
        assert y.tolist() == list(range(10 * i + 1, 10 * i + 11))
    with pytest.raises(ValueError, match="fewer than one sequence"):
        PackedSequences(path, vocab_size=1000, seq_len=200)
