"""CEM attention's scores, softmax and weighted sum as one fused kernel: FlexAttention.

The causal ALiBi bias of paper App. A is a ``score_mod`` (computed per score inside the kernel,
never a (K, T, T) tensor) and causality a block mask over the keys before each query; the
query's own key, with the learned self/cross bias, is merged in after the kernel through its
log-sum-exp, so that no learnable scalar is read inside it (``alibi_flex_attention``). On a GPU
the kernel is compiled (``torch.compile``, Triton); on a CPU torch runs FlexAttention's unfused
eager implementation, forward only.

The compiled kernel takes FlexAttention's tuning options (block sizes, warps, pipeline stages
and flags; ``FlexKernelOptions``, prefixed ``fwd_``/``bwd_`` for one pass): those measured
fastest for the card, head width and dtype (``TUNED_OPTIONS``), else Inductor's choice; the JSON
object in the environment variable ``CEMLAB_FLEX_KERNEL_OPTIONS``, read at import, replaces
them. ``python -m workloads.lm.attention_bench --sweep`` measures candidates on a card.
"""

from __future__ import annotations

import functools
import json
import os

import torch
from torch.nn.attention.flex_attention import (
    AuxRequest,
    BlockMask,
    create_block_mask,
    flex_attention,
)


def _kernel_options_from_env() -> dict:
    """``CEMLAB_FLEX_KERNEL_OPTIONS`` as a dict (empty when unset).

    Raises:
        ValueError: the variable is set but is not a JSON object.
    """
    text = os.environ.get("CEMLAB_FLEX_KERNEL_OPTIONS", "").strip()
    try:
        options = json.loads(text) if text else {}
    except ValueError:
        options = None
    if not isinstance(options, dict):
        raise ValueError(f"CEMLAB_FLEX_KERNEL_OPTIONS: expected a JSON object, got {text!r}")
    return options


KERNEL_OPTIONS = _kernel_options_from_env()

# {(compute capability, d_head, dtype): options}: the fastest set of `attention_bench --sweep`
# at cem-134m's sizes (docs/benchmarks.md). On an H100 in bf16 at d_head 64: 64 x 64 tiles in
# both passes (4 warps, 3 stages) and the causal mask's blocks taken as contiguous, a kernel call
# with its backward 1.48 ms against Inductor's default 1.84 ms.
TUNED_OPTIONS: dict[tuple[tuple[int, int], int, torch.dtype], dict] = {
    ((9, 0), 64, torch.bfloat16): {
        "BLOCKS_ARE_CONTIGUOUS": True,
        "fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "fwd_num_warps": 4, "fwd_num_stages": 3,
        "bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
        "bwd_num_warps": 4, "bwd_num_stages": 3},
}


def kernel_options(q: torch.Tensor) -> dict | None:
    """The compiled kernel's tuning options for queries ``q`` (..., T, E) on a CUDA device:
    ``CEMLAB_FLEX_KERNEL_OPTIONS`` if set, else ``TUNED_OPTIONS`` for the device's compute
    capability, E and q's dtype, else None (Inductor's defaults)."""
    if KERNEL_OPTIONS:
        return KERNEL_OPTIONS
    props = torch.cuda.get_device_properties(q.device)
    return TUNED_OPTIONS.get(((props.major, props.minor), q.shape[-1], q.dtype))


@functools.cache
def _compiled_flex_attention():
    return torch.compile(flex_attention, dynamic=False)


def _before(b, h, q_idx, kv_idx):
    return q_idx > kv_idx


@functools.lru_cache(maxsize=16)
def strictly_causal_block_mask(seq_len: int, device: torch.device) -> BlockMask:
    """The block mask of j < i for ``seq_len`` queries and keys on ``device`` (cached): each
    query's keys but its own."""
    return create_block_mask(_before, None, None, seq_len, seq_len, device=device)


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
    score inside the kernel; its gradient flows).

    The kernel attends over the keys j < i, with the ALiBi slope and c_ij as its ``score_mod``,
    and returns their log-sum-exp l'_ik and weighted mean o'_ik; the query's own key is merged
    in afterwards, as one more softmax partition: with s_iik = scale q_ikᵀ k_ik + c_ii + b_self
    - b_cross (b_cross is the same for every key j < i, and a row constant leaves the softmax
    unchanged), l_ik = logaddexp(l'_ik, s_iik) and o_ik = exp(l'_ik - l_ik) o'_ik
    + exp(s_iik - l_ik) v_ik. Both weights lie in [0, 1], so nothing cancels; the first query,
    which has no key before it, gets l' = -inf and o' = 0 from the kernel, hence o = v. The
    learnable biases thus never enter the kernel: a gradient of a tensor that a ``score_mod``
    reads is an atomic add from every score, which onto two scalars serialises B K T² / 2 adds
    (and sums them in bf16). c_ij's gradient is still such an add, K-fold per entry,
    into fp32 (torch accumulates a ``score_mod`` tensor's gradient in fp32 and then casts it to
    the tensor's dtype). The kernel reads c_ij in its own dtype: bf16 when training in bf16, as
    the bf16 product that computed it rounded it.

    On a GPU, E and Ev should stay near a head's width: the kernel's tiles hold whole rows of
    q, k and v in shared memory, which a diagonal carried as d_model extra columns (832 at
    d_model 768) overflows on a Hopper GPU (227 KB).
    Compiled where ``q`` is on a GPU.

    Raises:
        NotImplementedError: (torch) on a CPU, when an input requires a gradient.
    """
    # FlexAttention's grid runs one head's query blocks for every batch element, then the next
    # head. Given the heads as its batch and the batch as its heads (the transposes, views),
    # the programs in flight are one sequence's heads, which share each tile of c_ij, and the
    # adds into its gradient, in the L2 cache, instead of each head reading all of c in turn.
    def score_mod(score, head, batch, q_idx, kv_idx):
        return score - slopes[head] * (q_idx - kv_idx)

    acc = torch.promote_types(q.dtype, torch.float32)  # the merge's dtype: fp32 or fp64
    own = scale * (q.to(acc) * k.to(acc)).sum(-1) + (self_bias - cross_bias).to(acc)  # (B, K, T)
    if shared_scores is not None:
        # Read in its own dtype: in bf16 training it is a bf16 product already, so an fp32 copy
        # holds the same values in twice the bytes, which every head reads again. Compiled, the
        # kernel accumulates its gradient in fp32 either way and, since torch 2.11, casts it
        # back to bf16 (before, a compiled backward failed on the mix). Compiled, Inductor kept
        # the product's scaling by 1/sqrt(d_head) in fp32 for the copy: exact for d_head 16 or
        # 64, else now one more bf16 rounding of c_ij, the size of q's and k's own.
        own = own + shared_scores.diagonal(dim1=-2, dim2=-1)[:, None].to(acc)

        def shared_score_mod(score, head, batch, q_idx, kv_idx):
            return (score_mod(score, head, batch, q_idx, kv_idx)
                    + shared_scores[batch, q_idx, kv_idx])

    attend = _compiled_flex_attention() if q.is_cuda else flex_attention
    before, aux = attend(*(x.transpose(0, 1) for x in (q, k, v)),  # (K, B, T, .)
                         score_mod=score_mod if shared_scores is None else shared_score_mod,
                         scale=scale, return_aux=AuxRequest(lse=True),
                         block_mask=strictly_causal_block_mask(q.shape[-2], q.device),
                         kernel_options=kernel_options(q) if q.is_cuda else None)
    before, before_lse = before.transpose(0, 1), aux.lse.transpose(0, 1)  # (B, K, T, .)
    lse = torch.logaddexp(before_lse, own)
    out = (before_lse - lse).exp()[..., None] * before + (own - lse).exp()[..., None] * v
    return out.to(v.dtype)
