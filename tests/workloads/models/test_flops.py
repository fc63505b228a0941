"""Analytic FLOPs against torch.utils.flop_counter, for every kind of variant."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from workloads.models import ModelConfig, build_model, flops_per_token

BASE = {"vocab_size": 64, "d_model": 32, "n_layer": 2, "n_head": 2, "d_mlp": 48,
        "context_length": 64}
VARIANTS = [
    {}, {"position": "alibi"}, {"attn_steps": 2, "mlp_steps": 2},
    {"attention": "cem"}, {"mlp": "cem"},
    {"attention": "cem", "mlp": "cem", "attn_steps": 2, "mlp_steps": 2, "kq_diag": "shared",
     "attn_preconditioner": "diag_lowrank", "mlp_preconditioner": "diag_lowrank"},
    {"attention": "cem", "kq_diag": "per_head", "energy_exact": True,
     "attn_preconditioner": "diag"},
    {"attention": "cem", "update": "newton", "kq_diag": "shared", "energy_exact": True},
    {"attention": "cem", "update": "nesterov", "attn_steps": 3},
    {"attention": "cem", "mlp": "cem", "layer_reuse": True, "attn_steps": 2, "mlp_steps": 3},
    {"attention": "cem", "mlp": "cem", "preconditioner_psd": True,
     "attn_preconditioner": "diag_lowrank", "mlp_preconditioner": "diag_lowrank"},
    {"attention": "cem", "kq_diag": "per_head", "energy_exact": True,
     "attn_preconditioner": "diag_lowrank", "attn_precond_placement": "shared"},
    {"attention": "cem", "attn_preconditioner": "diag_lowrank",
     "attn_precond_placement": "shared"},
]


@pytest.mark.parametrize("overrides", VARIANTS, ids=lambda o: ",".join(map(str, o.values())))
@pytest.mark.parametrize("seq_len", [32, 64])
def test_flops_per_token_matches_the_flop_counter(overrides, seq_len):
    cfg = ModelConfig(**BASE, **overrides)
    model = build_model(cfg)
    idx = torch.randint(0, cfg.vocab_size, (16, seq_len))  # amortises weight-only products
    # The math SDPA backend decomposes attention into matmuls the counter sees.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(idx).sum().backward()
    counted = counter.get_total_flops() / idx.numel()
    assert flops_per_token(cfg, seq_len) == pytest.approx(counted, rel=0.05)
