"""Position encodings: RoPE (Su et al., 2024) for Llama, ALiBi (Press et al., 2022) for CEM."""

from __future__ import annotations

import math

import torch


def alibi_slopes(n_head: int) -> torch.Tensor:
    """ALiBi head slopes m_k, shape (n_head,), as in Press et al.'s ``get_slopes``.

    For a power of two n the slopes are the geometric sequence 2^(-8/n), 2^(-16/n), ...; otherwise
    the slopes of the closest smaller power of two are followed by every other slope of the next
    one (12 heads: 2^-1 ... 2^-8, then 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5).
    """

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start ** (i + 1) for i in range(n)]

    if math.log2(n_head).is_integer():
        slopes = power_of_two(n_head)
    else:
        closest = 2 ** math.floor(math.log2(n_head))
        slopes = power_of_two(closest) + power_of_two(2 * closest)[0::2][: n_head - closest]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi_bias(slopes: torch.Tensor, seq_len: int, self_bias: torch.Tensor,
               cross_bias: torch.Tensor) -> torch.Tensor:
    """Causal additive score bias b_ijk of paper App. A, shape (n_head, T, T).

    b_ijk = -m_k (i - j) + [i == j] b_self + [i != j] b_cross for j <= i, and -inf for j > i.
    ``slopes`` (n_head,), ``self_bias`` and ``cross_bias`` scalars (learnable).
    """
    pos = torch.arange(seq_len, device=slopes.device)
    dist = (pos[:, None] - pos[None, :]).to(slopes.dtype)  # (T, T), i - j
    eye = torch.eye(seq_len, device=slopes.device, dtype=slopes.dtype)
    bias = -slopes[:, None, None] * dist + eye * self_bias + (1 - eye) * cross_bias
    return bias.masked_fill(dist < 0, float("-inf"))


def sdpa_mask(bias: torch.Tensor) -> torch.Tensor:
    """``bias`` (K, T, T), or (B, K, T, T), as the 4-D float mask of
    ``F.scaled_dot_product_attention``: torch's fused CPU kernel takes a 2-D or a 4-D mask only
    and runs the math kernel for a 3-D one (8x slower at ``micro`` without gradients). With a
    mask that needs a gradient (training the self/cross bias) the CPU runs the math kernel
    anyway."""
    return bias[None] if bias.dim() == 3 else bias


def sdpa_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
               scale: float) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)`` as torch's math
    kernel computes it, which is the kernel a CPU runs when the mask needs a gradient: q and k
    at least in fp32 (bf16 is upcast), each times sqrt(scale), their product plus the mask, the
    softmax, times v, back to q's dtype. It leaves out that kernel's guard for rows that see no
    key (``isneginf``, ``all`` and ``where`` over every score), which a causal row, seeing
    itself, never is.

    Shapes: q (B, K, T, E), k (B, K, T, E), v (B, K, T, Ev), mask (T, T), (K, T, T) or
    (B, K, T, T);
    returns (B, K, T, Ev). Equal to SDPA bit for bit, outputs and gradients, in fp32 and bf16
    (torch 2.13 on a CPU), and faster: it skips the kernel's guard.
    """
    acc, root = torch.promote_types(q.dtype, torch.float32), math.sqrt(scale)
    scores = (q.to(acc) * root) @ (k.to(acc) * root).transpose(-2, -1) + mask.to(acc)
    return (torch.softmax(scores, dim=-1) @ v.to(acc)).to(q.dtype)


def rope_cos_sin(seq_len: int, d_head: int, theta: float, device: torch.device | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables ``cos, sin`` of shape (T, d_head), in the half-split (Llama/HF) layout."""
    inv_freq = 1.0 / theta ** (torch.arange(0, d_head, 2, device=device, dtype=torch.float32)
                               / d_head)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)  # (T, d_head)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, K, T, d_head) by the RoPE tables (T, d_head)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)
