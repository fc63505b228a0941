"""Token shards and packed sequences: consecutive windows of the concatenated stream."""

import numpy as np
import pytest
import torch

from workloads.lm.data import PackedSequences
from workloads.lm.data.packing import ShardWriter


def test_packed_sequences_are_consecutive_windows_without_padding(tmp_path):
    path = tmp_path / "s.bin"
    stream = np.arange(103, dtype=np.uint16)
    stream.tofile(path)
    ds = PackedSequences([path], vocab_size=1000, seq_len=10)
    assert len(ds) == 10  # (103 - 1) // 10
    for i in range(len(ds)):
        x, y = ds[i]
        assert x.dtype == torch.int64 and x.shape == y.shape == (10,)
        assert x.tolist() == list(range(10 * i, 10 * i + 10))
        assert y.tolist() == list(range(10 * i + 1, 10 * i + 11))
    with pytest.raises(ValueError, match="fewer than one sequence"):
        PackedSequences([path], vocab_size=1000, seq_len=200)


@pytest.mark.parametrize("cuts", [[1000], [7, 993], [1, 1, 998], [250, 250, 250, 250],
                                  [333, 0, 333, 334]])
def test_shards_are_fixed_size_whatever_the_writes_and_windows_span_them(tmp_path, cuts):
    rng = np.random.default_rng(0)
    stream = rng.integers(0, 5000, 1000).astype(np.uint16)
    writer = ShardWriter(tmp_path, "train", vocab_size=5000, shard_tokens=64)
    for piece in np.split(stream, np.cumsum(cuts)[:-1]):
        writer.write(piece)
    names = writer.close()
    assert names == [f"train-{i:05d}.bin" for i in range(16)]  # ceil(1000 / 64)
    sizes = [(tmp_path / n).stat().st_size // 2 for n in names]
    assert sizes == [64] * 15 + [1000 - 15 * 64]
    assert writer.n_tokens == 1000
    assert (writer.counts == np.bincount(stream, minlength=5000)).all()

    ds = PackedSequences([tmp_path / n for n in names], vocab_size=5000, seq_len=50)
    assert len(ds) == 19  # (1000 - 1) // 50, windows straddle the 64-token shards
    for i in range(len(ds)):
        x, y = ds[i]
        assert x.tolist() == stream[50 * i: 50 * i + 50].tolist()
        assert y.tolist() == stream[50 * i + 1: 50 * i + 51].tolist()
