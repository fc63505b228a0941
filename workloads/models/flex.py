"""CEM attention's scores, softmax and weighted sum as one fused kernel: FlexAttention.

The causal ALiBi + self/cross bias of paper App. A is a ``score_mod`` (computed per score inside
the kernel, never a (K, T, T) tensor) and causality a block mask, so the bias's gradient comes
out of the fused backward. On a GPU the kernel is compiled (``torch.compile``, Triton); on a
CPU torch runs FlexAttention's unfused eager implementation, forward only.
"""

from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention


@functools.cache
def _compiled_flex_attention():
    return torch.compile(flex_attention, dynamic=False)


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@functools.lru_cache(maxsize=16)
def causal_block_mask(seq_len: int, device: torch.device) -> BlockMask:
    """The block mask of j <= i for ``seq_len`` queries and keys on ``device`` (cached)."""
    return create_block_mask(_causal, None, None, seq_len, seq_len, device=device)


def alibi_flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         slopes: torch.Tensor, self_bias: torch.Tensor,
                         cross_bias: torch.Tensor, scale: float,
                         shared_scores: torch.Tensor | None = None) -> torch.Tensor:
    """o_ik = sum_{j<=i} p_ijk v_jk, p_ijk = softmax_j(scale q_ikᵀ k_jk + c_ij + b_ijk), with the
    bias b_ijk = -m_k (i - j) + [i == j] b_self + [i != j] b_cross of ``position.alibi_bias``
    and c_ij = ``shared_scores`` (0 if None).

    ``q``, ``k`` (B, K, T, E), ``v`` (B, K, T, Ev) -> (B, K, T, Ev); ``slopes`` m_k (K,),
    ``self_bias``/``cross_bias`` (1,) (learnable: their gradients flow); ``shared_scores``
    (B, T, T), the same for every head (the shared KQ diagonal's scale h~_jᵀ D u_i, read per
    score inside the kernel; its gradient flows). b_cross is the same for every key j < i of a
    query, so the kernel adds only b_self - b_cross on the diagonal: the softmax is unchanged by
    a constant per row, hence the outputs and both gradients are too.

    On a GPU, E and Ev should stay near a head's width: the kernel's tiles hold whole rows of
    q, k and v in shared memory, and a diagonal carried as d_model extra columns (832 at
    d_model 768) needed 340 KB of it on an H200, which has 227 KB.
    Compiled where ``q`` is on a GPU.

    Raises:
        NotImplementedError: (torch) on a CPU, when an input requires a gradient.
    """
    diagonal = (self_bias - cross_bias).expand(q.shape[1]).contiguous()  # (K,): per head

    def score_mod(score, b, h, q_idx, kv_idx):
        return (score - slopes[h] * (q_idx - kv_idx)
                + torch.where(q_idx == kv_idx, diagonal[h], 0.0))

    def shared_score_mod(score, b, h, q_idx, kv_idx):
        return score_mod(score, b, h, q_idx, kv_idx) + shared_scores[b, q_idx, kv_idx]

    attend = _compiled_flex_attention() if q.is_cuda else flex_attention
    return attend(q, k, v, score_mod=score_mod if shared_scores is None else shared_score_mod,
                  scale=scale, block_mask=causal_block_mask(q.shape[-2], q.device))
