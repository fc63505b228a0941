"""Learning-rate schedule, weight decay by role and DeepSpeed config (paper Table 2)."""

import math

import pytest
import torch

from workloads.core.architecture import ModelConfig
from workloads.core.config import OptimizerConfig
from workloads.models.decoder import build_model
from workloads.runtime.optim import build_optimizer, deepspeed_config, lr_factor


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
    # engine.deepspeed merges key by key: a nested key joins its section's others
    more = deepspeed_config(8, 4, 2, 2, "bf16", 1.0, {"bf16": {"check_grad_overflow": False},
                                                     "zero_optimization": {"overlap_comm": True},
                                                     "steps_per_print": 7})
    assert more["bf16"] == {"enabled": True, "check_grad_overflow": False}
    assert more["zero_optimization"] == {"stage": 2, "overlap_comm": True}
    assert more["steps_per_print"] == 7 and more["train_batch_size"] == 64
    # bf16 skips DeepSpeed's overflow check; one worker at ZeRO 1-2 keeps no contiguous copy
    one = deepspeed_config(8, 1, 1, 1, "bf16", 1.0)
    assert one["bf16"] == {"enabled": True, "check_grad_overflow": False}
    assert one["zero_optimization"] == {"stage": 1, "contiguous_gradients": False}
    assert deepspeed_config(8, 1, 1, 3, "fp32", 1.0)["zero_optimization"] == {"stage": 3}
    assert deepspeed_config(8, 1, 1, 0, "fp32", 1.0)["bf16"] == {"enabled": False}


def test_weight_decay_by_role_not_rank():
    # Full CEM: per-head KQ diagonal (K, D), diag+low-rank preconditioners (K, D), (K, D, r),
    # learnable step sizes; every variant compared in Fig. 3b is decayed alike.
    cfg = ModelConfig.from_preset("nano", attention="cem", mlp="cem", kq_diag="per_head",
                                  attn_preconditioner="diag_lowrank",
                                  mlp_preconditioner="diag_lowrank", learn_step_size=True)
    model = build_model(cfg)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # a step with zero gradients moves only decayed weights
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    build_optimizer(model, OptimizerConfig(weight_decay=0.1), lr=0.1).step()
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    projections = {n for n in before if n.endswith(("_proj.weight", "embed_tokens.weight",
                                                    "lm_head.weight"))}
    assert moved == projections
    assert {"blocks.0.attn.kq_diag", "blocks.0.attn.precond.p", "blocks.0.attn.precond.lowrank_u",
            "blocks.0.mlp.step_size", "blocks.0.attn.norm.weight"} <= set(before) - moved
