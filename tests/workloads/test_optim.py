"""Learning-rate schedule and DeepSpeed config (paper Table 2)."""

import math

import pytest

from workloads.optim import deepspeed_config, lr_factor


def test_warmup_then_cosine_to_the_final_factor():
    total = 200
    f = [lr_factor(s, total, warmup_fraction=0.05, final_lr_fraction=0.1) for s in range(total)]
    assert f[0] == pytest.approx(1 / 10)
    assert f[9] == pytest.approx(1.0)  # ceil(5% of 200) = 10 warmup steps
    assert f[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(f[9:], f[10:]))
    mid = 10 + (total - 1 - 10) / 2
    assert lr_factor(math.floor(mid), total, 0.05, 0.1) == pytest.approx(
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (math.floor(mid) - 10) / (total - 11))))


def test_deepspeed_batch_geometry():
    cfg = deepspeed_config(micro_batch_size=8, grad_accum=4, world_size=2, zero_stage=2,
                           precision="bf16", grad_clip=1.0)
    assert cfg["train_batch_size"] == 64
    assert cfg["zero_optimization"]["stage"] == 2
    assert cfg["bf16"]["enabled"] is True
    assert cfg["gradient_clipping"] == 1.0
