"""Llama sublayers (pre-norm, residual inside): RoPE multi-head attention and SwiGLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workloads.core.architecture import ModelConfig
from workloads.models.position import (
    alibi_bias,
    alibi_slopes,
    apply_rope,
    rope_cos_sin,
    sdpa_mask,
    sdpa_math,
)


class LlamaAttention(nn.Module):
    """Pre-norm causal multi-head attention: ``h + o_proj(MHA(norm(h)))``, applied
    ``attn_steps`` times (plain layer reuse when > 1, Fig. 4).

    ``position: rope`` rotates q and k; ``position: alibi`` adds the same causal bias as CEM
    attention (slopes m_k and learnable self/cross biases, App. A), so a comparison can hold the
    position encoding fixed. Parameters ``q_proj, k_proj, v_proj, o_proj`` (D x D, no bias),
    ``norm``, and with ALiBi ``self_bias``/``cross_bias`` (1,). Input and output (B, T, D).
    """

    # ``auto``: torch's scaled_dot_product_attention (its fused kernels); ``math``: its math
    # kernel written out (``sdpa_math``), plain ops that ``torch.func.vmap`` batches for
    # stacked trials, where SDPA's fused CPU kernel has no batching rule.
    kernel: str = "auto"

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head, self.d_head, self.steps = cfg.n_head, cfg.d_head, cfg.attn_steps
        self.position = cfg.position
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.o_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        if cfg.position == "rope":
            cos, sin = rope_cos_sin(cfg.context_length, cfg.d_head, cfg.rope_theta)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        else:
            self.self_bias = nn.Parameter(torch.zeros(1))
            self.cross_bias = nn.Parameter(torch.zeros(1))
            self.register_buffer("alibi_slopes", alibi_slopes(cfg.n_head), persistent=False)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.n_head, self.d_head).transpose(1, 2)  # (B, K, T, Dh)

    def _layer(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        x = self.norm(h)
        q, k, v = (self._heads(p(x)) for p in (self.q_proj, self.k_proj, self.v_proj))
        if self.position == "rope":
            cos, sin = self.rope_cos[:t], self.rope_sin[:t]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            if self.kernel == "math":
                causal = torch.full((t, t), float("-inf"), device=h.device).triu(1)  # (T, T)
                o = sdpa_math(q, k, v, causal, self.d_head ** -0.5)
            else:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, K, T, Dh)
        else:
            bias = alibi_bias(self.alibi_slopes, t, self.self_bias, self.cross_bias).to(h.dtype)
            o = (sdpa_math(q, k, v, bias, self.d_head ** -0.5) if self.kernel == "math"
                 else F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask(bias)))
        return h + self.o_proj(o.transpose(1, 2).reshape(b, t, d))

    def forward(self, h: torch.Tensor, carry: dict | None = None) -> torch.Tensor:
        for _ in range(self.steps):
            h = self._layer(h)
        return h


class LlamaMLP(nn.Module):
    """Pre-norm SwiGLU MLP: ``h + down_proj(gate_proj(x) * SiLU(up_proj(x)))``, x = norm(h),
    applied ``mlp_steps`` times (plain layer reuse when > 1, Fig. 3c).

    This is Eq. 6 of the paper with sigma = SiLU; ``gate_proj, up_proj`` (D -> d_mlp) and
    ``down_proj`` (d_mlp -> D). Input and output (B, T, D).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.steps = cfg.mlp_steps
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.gate_proj = nn.Linear(cfg.d_model, cfg.d_mlp, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.d_mlp, bias=False)
        self.down_proj = nn.Linear(cfg.d_mlp, cfg.d_model, bias=False)

    def forward(self, h: torch.Tensor, carry: dict | None = None) -> torch.Tensor:
        for _ in range(self.steps):
            x = self.norm(h)
            h = h + self.down_proj(self.gate_proj(x) * F.silu(self.up_proj(x)))
        return h
