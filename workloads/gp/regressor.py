"""A stack of recursive CEM MLPs for regression (paper App. D, Table 3)."""

from __future__ import annotations

import torch
from torch import nn

from workloads.core.architecture import ModelConfig
from workloads.models.cem import CEMMLP


class GPRegressor(nn.Module):
    """``in_proj`` (input_dim -> d_model), ``n_layer`` CEM MLPs with ``mlp_steps`` = T recursion
    steps each (Eq. 7-11; the ``mlp_*`` fields of ``cfg`` apply), a final RMSNorm and a scalar
    ``head``. Only ``d_model``, ``n_layer``, ``d_mlp`` and the ``mlp_*`` fields of ``cfg`` are
    used. ``model(x)`` with ``x`` (B, input_dim) returns (B,).
    """

    def __init__(self, cfg: ModelConfig, input_dim: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.in_proj = nn.Linear(input_dim, cfg.d_model)
        self.blocks = nn.ModuleList(CEMMLP(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, 1)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=cfg.init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.in_proj(x)  # (B, D)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h)).squeeze(-1)  # (B,)


def gp_flops_per_sample(cfg: ModelConfig, input_dim: int) -> float:
    """Forward + backward matmul FLOPs per example: in_proj, per layer gamma = W h~ once and
    ``mlp_steps`` x (V u, Vᵀ a), the head; tripled for the backward pass."""
    d, f = cfg.d_model, cfg.d_mlp
    gamma = 2 * d * f
    per_layer = cfg.mlp_steps * (4 * d * f + (gamma if cfg.layer_reuse else 0)) + (
        0 if cfg.layer_reuse else gamma)
    return 3.0 * (2 * input_dim * d + cfg.n_layer * per_layer + 2 * d)
