"""Pieces of the training loop that run without Ray: resumed data order, sequence NLL."""

import itertools
import math

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from workloads.train import _forever, sequence_nll


def batches(skip: int, n: int):
    data = TensorDataset(torch.arange(10))
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=3)
    stream = _forever(DataLoader(data, batch_size=3, sampler=sampler), sampler, skip=skip)
    return [b[0].tolist() for b in itertools.islice(stream, n)]


def test_a_resumed_stream_continues_where_the_uninterrupted_one_was():
    whole = batches(0, 12)  # 4 batches per epoch (drop_last off: 3 + 3 + 3 + 1)
    for skip in (1, 4, 5, 9):
        assert batches(skip, 12 - skip) == whole[skip:]
    assert whole[:4] != whole[4:8]  # every epoch is reshuffled


class Bigram(torch.nn.Module):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(vocab, vocab)

    def forward(self, x):
        return self.table(x)


def test_sequence_nll_counts_real_sequences_only():
    torch.manual_seed(0)
    seqs = [(torch.randint(8, (5,)), torch.randint(8, (5,))) for _ in range(3)]
    model = Bigram(8)
    nll, n = sequence_nll(model, seqs, [0, 2, -1, -1], batch_size=3, device=torch.device("cpu"))
    expected = sum(F.cross_entropy(model(x), y, reduction="sum").item()
                   for x, y in (seqs[0], seqs[2]))
    assert n == 10 and math.isclose(nll, expected, rel_tol=1e-6)
