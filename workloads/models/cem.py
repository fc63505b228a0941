"""CEM sublayers: weight-tied attention and MLP as gradient steps on explicit energies.

Each sublayer takes the residual stream ``h`` (B, T, D) and returns the last iterate ``x^(T)``;
the residual is absorbed into the update ``x^(t+1) = x^(t) - eta * grad``. Each owns one RMSNorm
``norm``, applied to ``h`` for the fixed side (keys/values, gamma) and to every iterate for the
query side (paper Algorithm 1, as reconstructed in docs/DESIGN.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workloads.models.config import ModelConfig
from workloads.models.position import alibi_bias, alibi_slopes


class CEMAttention(nn.Module):
    """Weight-tied attention: descent on the interaction energy (paper Eq. 1-5, App. A).

    With ``h~ = norm(h)``, keys (= values) ``k_j = W^K h~_j`` are computed once; then for
    t = 0..T-1, ``u = norm(x^(t))``, ``q_i = W^Q u_i`` and

        s_ijk = k_jᵀ q_i / tau - m_k (i - j) + [i == j] b_self + [i != j] b_cross   (j <= i)
        x_i^(t+1) = x_i^(t) + eta * sum_k W^Q_kᵀ sum_j softmax_j(s_ijk) k_j

    with tau = sqrt(d_head). The sum is -grad_u of eps(u | h~) = -tau sum_k log sum_j exp(s_ijk)
    (Eq. 2, 4). Parameters: ``q_proj`` (W^Q, D -> K*Dh, also the output map W^Qᵀ, Eq. 5),
    ``k_proj`` (W^K, also the value map), scalars ``self_bias``/``cross_bias`` (shape (1,)); buffer
    ``alibi_slopes`` (K,). Input and output (B, T, D).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head, self.d_head = cfg.n_head, cfg.d_head
        self.steps, self.step_size = cfg.attn_steps, cfg.attn_step_size
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_head * cfg.d_head, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.n_head * cfg.d_head, bias=False)
        # Scalars as in App. A, stored with shape (1,): DeepSpeed's bf16 path cannot flatten 0-dim.
        self.self_bias = nn.Parameter(torch.zeros(1))
        self.cross_bias = nn.Parameter(torch.zeros(1))
        self.register_buffer("alibi_slopes", alibi_slopes(cfg.n_head), persistent=False)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.n_head, self.d_head).transpose(1, 2)  # (B, K, T, Dh)

    def score_bias(self, seq_len: int, dtype: torch.dtype) -> torch.Tensor:
        """The causal ALiBi + self/cross bias b_ijk, shape (K, T, T)."""
        return alibi_bias(self.alibi_slopes, seq_len, self.self_bias, self.cross_bias).to(dtype)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        k = self._heads(self.k_proj(self.norm(h)))  # (B, K, T, Dh): keys = values, fixed
        bias = self.score_bias(t, h.dtype)  # (K, T, T)
        x = h
        for _ in range(self.steps):
            q = self._heads(self.q_proj(self.norm(x)))  # (B, K, T, Dh)
            o = F.scaled_dot_product_attention(q, k, k, attn_mask=bias)  # scale 1/sqrt(Dh)
            g = o.transpose(1, 2).reshape(b, t, d) @ self.q_proj.weight  # (B, T, D): W^Qᵀ o
            x = x + self.step_size * g
        return x


class CEMMLP(nn.Module):
    """Weight-tied gated MLP: descent on the element-wise energy (paper Eq. 7-11).

    ``gamma = W h~`` is fixed across steps; for t = 0..T-1, ``u = norm(x^(t))`` and

        x^(t+1) = x^(t) + eta * Vᵀ (gamma ∘ SiLU(V u))

    which is -grad_u of xi(u | h~) = -gammaᵀ phi(V u) with phi(x) = int_0^x SiLU (Eq. 8-10).
    Parameters ``gate_proj`` (W: D -> d_mlp) and ``up_proj`` (V: D -> d_mlp; Vᵀ is the down map,
    Eq. 11). Input and output (B, T, D).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.steps, self.step_size = cfg.mlp_steps, cfg.mlp_step_size
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.gate_proj = nn.Linear(cfg.d_model, cfg.d_mlp, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.d_mlp, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        gamma = self.gate_proj(self.norm(h))  # (B, T, d_mlp), fixed
        x = h
        for _ in range(self.steps):
            a = gamma * F.silu(self.up_proj(self.norm(x)))  # (B, T, d_mlp)
            x = x + self.step_size * (a @ self.up_proj.weight)  # Vᵀ a: (B, T, D)
        return x
