"""Llama sublayers (pre-norm, residual inside): RoPE multi-head attention and SwiGLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workloads.models.config import ModelConfig
from workloads.models.position import apply_rope, rope_cos_sin


class LlamaAttention(nn.Module):
    """Pre-norm causal multi-head attention with RoPE: ``h + o_proj(MHA(norm(h)))``.

    Input and output: the residual stream ``h`` (B, T, D). Parameters ``q_proj, k_proj, v_proj,
    o_proj`` (D x D each, no bias) and the RMSNorm ``norm``.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head, self.d_head = cfg.n_head, cfg.d_head
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.o_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        cos, sin = rope_cos_sin(cfg.context_length, cfg.d_head, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.n_head, self.d_head).transpose(1, 2)  # (B, K, T, Dh)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        x = self.norm(h)
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        q = apply_rope(self._heads(self.q_proj(x)), cos, sin)
        k = apply_rope(self._heads(self.k_proj(x)), cos, sin)
        v = self._heads(self.v_proj(x))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, K, T, Dh)
        return h + self.o_proj(o.transpose(1, 2).reshape(b, t, d))


class LlamaMLP(nn.Module):
    """Pre-norm SwiGLU MLP: ``h + down_proj(gate_proj(x) * SiLU(up_proj(x)))``, x = norm(h).

    This is Eq. 6 of the paper with sigma = SiLU; ``gate_proj, up_proj`` (D -> d_mlp) and
    ``down_proj`` (d_mlp -> D). Input and output (B, T, D).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.gate_proj = nn.Linear(cfg.d_model, cfg.d_mlp, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.d_mlp, bias=False)
        self.down_proj = nn.Linear(cfg.d_mlp, cfg.d_model, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.norm(h)
        return h + self.down_proj(self.gate_proj(x) * F.silu(self.up_proj(x)))
