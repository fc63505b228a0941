"""CEM attention's scores, softmax and weighted sum, forward and backward, as Triton kernels.

One step of CEM attention (paper Eq. 1-5, App. A; docs/DESIGN.md) attends, for every head k
and query i, over the keys j <= i with the scores

    s_ijk = scale q_ikᵀ k_jk + c_ij - m_k (i - j) + [i == j] b_self + [i != j] b_cross
    c_ij  = scale cq_iᵀ ck_j        (the shared KQ diagonal: cq = D u, ck = h~; else 0)

and returns o_ik = sum_j p_ijk v_jk, p = softmax_j s (``cem_attention``). c, the same
(B, T, T) term for every head, is one batched matrix product in the input dtype (cuBLAS on a
GPU), outside the kernels, and its gradient reaches cq and ck through that product's own
backward. The kernels:

* forward: one program per (sequence, head, query tile), over the key tiles at or below the
  diagonal, reading c's tile; the query's own key is one more score of the diagonal tile: the
  learned biases enter as their difference b_self - b_cross at i == j (a constant over a row
  leaves the softmax unchanged). It stores o and the log-sum-exp l_ik of the scores.
* backward, dq: one program per (sequence, head, query tile), over the key tiles, recomputing
  p from l and dS_ijk = p_ijk (dp_ijk - delta_ik) with dp_ijk = dO_ikᵀ v_jk and
  delta_ik = dO_ikᵀ o_ik; dq stays in registers.
* backward, dk and dv: one program per (sequence, head, key tile), over the query tiles at or
  below the diagonal, from the same recomputed p and dS.
* backward, c's gradient dc_ij = sum_k dS_ijk: one program per (sequence, query tile, key
  tile) at or below the diagonal, the heads inner, dc summed in registers and stored once (no
  atomic adds); above the diagonal dc is zero.

The gradient of b_self - b_cross is sum_{b,k,i} dS_iik, computed outside the kernels from l
(a sum over T values per head and sequence); b_self receives it and b_cross its negative
(a row of dS sums to zero).

The query-tile programs start from the last tiles, which see the most keys. Accumulation is
in fp32 (fp64 for fp64 inputs); p and dS are rounded to the input dtype before their matrix
products, as in FlashAttention. On a GPU the kernels are compiled by
Triton; on a CPU they run only under Triton's interpreter (``TRITON_INTERPRET=1`` set before
``triton`` is first imported), slowly, for tests. The ops are ``torch.library`` custom ops
(``cemlab::cem_attention_forward`` and ``..._backward``), so ``torch.compile`` keeps them whole.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

# -- kernels ----------------------------------------------------------------------------------

@triton.jit
def _scores(q, k, c, slope, own, offs_m, offs_n, T, scale, ACC: tl.constexpr,
            PRECISION: tl.constexpr):
    """The tile of s (BLOCK_M, BLOCK_N) in ACC, -inf where j > i or j >= T."""
    s = tl.dot(q, tl.trans(k), out_dtype=ACC, input_precision=PRECISION) * scale + c
    diff = offs_m[:, None] - offs_n[None, :]
    s = s - slope * diff.to(ACC) + tl.where(diff == 0, own, 0.0).to(ACC)
    return tl.where((diff >= 0) & (offs_n < T)[None, :], s, float("-inf"))


@triton.jit
def _c_tile(c_ptr, b, offs_m, offs_n, T, HAS_C: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, ACC: tl.constexpr):
    """c's tile (BLOCK_M, BLOCK_N) of sequence b in ACC, 0 outside [0, T)^2 or without c."""
    if HAS_C:
        ok = (offs_m < T)[:, None] & (offs_n < T)[None, :]
        c = tl.load(c_ptr + b * T * T + offs_m[:, None] * T + offs_n[None, :], mask=ok,
                    other=0.0).to(ACC)
    else:
        c = tl.full((BLOCK_M, BLOCK_N), 0.0, ACC)
    return c


@triton.jit
def _rows(ptr, rows, offs, T, width, offs_w):
    """The rows ``offs`` (< T) of a (T, width) slab starting at row ``rows``, 0 past T."""
    return tl.load(ptr + (rows + offs)[:, None] * width + offs_w[None, :],
                   mask=(offs < T)[:, None] & (offs_w < width)[None, :], other=0.0)


@triton.jit
def _query_side(q_ptr, do_ptr, lse_ptr, delta_ptr, rows, offs_m, T, E, EV, offs_e, offs_ev):
    """The backward's query rows ``offs_m`` of one (sequence, head): q, dO, the log-sum-exp l
    and delta = rowsum(dO o), 0 past T."""
    row_ok = offs_m < T
    return (_rows(q_ptr, rows, offs_m, T, E, offs_e), _rows(do_ptr, rows, offs_m, T, EV, offs_ev),
            tl.load(lse_ptr + rows + offs_m, mask=row_ok, other=0.0),
            tl.load(delta_ptr + rows + offs_m, mask=row_ok, other=0.0))


@triton.jit
def _forward_kernel(q_ptr, k_ptr, v_ptr, c_ptr, slopes_ptr, own_ptr, o_ptr, lse_ptr, scale,
                    T, K, E, EV, HAS_C: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr,
                    ACC: tl.constexpr, PRECISION: tl.constexpr):
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest (last) tiles first
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // K, bh % K
    rows = bh * T
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_e = tl.arange(0, BLOCK_E)
    offs_ev = tl.arange(0, BLOCK_EV)
    row_ok = offs_m < T
    own = tl.load(own_ptr).to(ACC)
    slope = tl.load(slopes_ptr + h).to(ACC)
    q = _rows(q_ptr, rows, offs_m, T, E, offs_e)
    m_i = tl.full((BLOCK_M,), float("-inf"), ACC)
    l_i = tl.full((BLOCK_M,), 0.0, ACC)
    acc = tl.full((BLOCK_M, BLOCK_EV), 0.0, ACC)
    for n_start in range(0, tl.minimum((m_block + 1) * BLOCK_M, T), BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        k = _rows(k_ptr, rows, offs_n, T, E, offs_e)
        c = _c_tile(c_ptr, b, offs_m, offs_n, T, HAS_C, BLOCK_M, BLOCK_N, ACC)
        s = _scores(q, k, c, slope, own, offs_m, offs_n, T, scale, ACC, PRECISION)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _rows(v_ptr, rows, offs_n, T, EV, offs_ev)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, out_dtype=ACC,
                                            input_precision=PRECISION)
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(o_ptr + (rows + offs_m)[:, None] * EV + offs_ev[None, :],
             o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_ev < EV)[None, :])
    tl.store(lse_ptr + rows + offs_m, m_i + tl.log(l_i), mask=row_ok)


@triton.jit
def _p_and_ds(q, k, v, do, lse, delta, c, slope, own, offs_m, offs_n, T, scale,
              ACC: tl.constexpr, PRECISION: tl.constexpr):
    """p and dS (BLOCK_M, BLOCK_N) in ACC, recomputed from the log-sum-exp; 0 where masked."""
    s = _scores(q, k, c, slope, own, offs_m, offs_n, T, scale, ACC, PRECISION)
    p = tl.where((offs_m < T)[:, None], tl.exp(s - lse[:, None]), 0.0)
    dp = tl.dot(do, tl.trans(v), out_dtype=ACC, input_precision=PRECISION)
    return p, p * (dp - delta[:, None])


@triton.jit
def _backward_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, c_ptr, slopes_ptr,
                        own_ptr, dq_ptr, scale, T, K, E, EV, HAS_C: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
                        BLOCK_EV: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr):
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest (last) tiles first
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // K, bh % K
    rows = bh * T
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_e = tl.arange(0, BLOCK_E)
    offs_ev = tl.arange(0, BLOCK_EV)
    row_ok = offs_m < T
    own = tl.load(own_ptr).to(ACC)
    slope = tl.load(slopes_ptr + h).to(ACC)
    q, do, lse, delta = _query_side(q_ptr, do_ptr, lse_ptr, delta_ptr, rows, offs_m, T, E, EV,
                                    offs_e, offs_ev)
    dq = tl.full((BLOCK_M, BLOCK_E), 0.0, ACC)
    for n_start in range(0, tl.minimum((m_block + 1) * BLOCK_M, T), BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        k = _rows(k_ptr, rows, offs_n, T, E, offs_e)
        v = _rows(v_ptr, rows, offs_n, T, EV, offs_ev)
        c = _c_tile(c_ptr, b, offs_m, offs_n, T, HAS_C, BLOCK_M, BLOCK_N, ACC)
        p, ds = _p_and_ds(q, k, v, do, lse, delta, c, slope, own, offs_m, offs_n, T, scale,
                          ACC, PRECISION)
        dq += tl.dot(ds.to(k.dtype), k, out_dtype=ACC, input_precision=PRECISION)
    tl.store(dq_ptr + (rows + offs_m)[:, None] * E + offs_e[None, :],
             (scale * dq).to(dq_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (offs_e < E)[None, :])


@triton.jit
def _backward_dkv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, c_ptr, slopes_ptr,
                         own_ptr, dk_ptr, dv_ptr, scale, T, K, E, EV, HAS_C: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
                         BLOCK_EV: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr):
    n_block = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // K, bh % K
    rows = bh * T
    offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_e = tl.arange(0, BLOCK_E)
    offs_ev = tl.arange(0, BLOCK_EV)
    col_ok = offs_n < T
    own = tl.load(own_ptr).to(ACC)
    slope = tl.load(slopes_ptr + h).to(ACC)
    k = _rows(k_ptr, rows, offs_n, T, E, offs_e)
    v = _rows(v_ptr, rows, offs_n, T, EV, offs_ev)
    dk = tl.full((BLOCK_N, BLOCK_E), 0.0, ACC)
    dv = tl.full((BLOCK_N, BLOCK_EV), 0.0, ACC)
    m_begin = (n_block * BLOCK_N // BLOCK_M) * BLOCK_M  # the first query tile with a row >= j
    for m_start in range(m_begin, T, BLOCK_M):
        offs_m = m_start + tl.arange(0, BLOCK_M)
        q, do, lse, delta = _query_side(q_ptr, do_ptr, lse_ptr, delta_ptr, rows, offs_m, T, E,
                                        EV, offs_e, offs_ev)
        c = _c_tile(c_ptr, b, offs_m, offs_n, T, HAS_C, BLOCK_M, BLOCK_N, ACC)
        p, ds = _p_and_ds(q, k, v, do, lse, delta, c, slope, own, offs_m, offs_n, T, scale,
                          ACC, PRECISION)
        dv += tl.dot(tl.trans(p.to(do.dtype)), do, out_dtype=ACC, input_precision=PRECISION)
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q, out_dtype=ACC, input_precision=PRECISION)
    tl.store(dk_ptr + (rows + offs_n)[:, None] * E + offs_e[None, :],
             (scale * dk).to(dk_ptr.dtype.element_ty),
             mask=col_ok[:, None] & (offs_e < E)[None, :])
    tl.store(dv_ptr + (rows + offs_n)[:, None] * EV + offs_ev[None, :],
             dv.to(dv_ptr.dtype.element_ty), mask=col_ok[:, None] & (offs_ev < EV)[None, :])


@triton.jit
def _backward_dc_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, c_ptr, slopes_ptr,
                        own_ptr, dc_ptr, scale, T, K, E, EV, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr,
                        ACC: tl.constexpr, PRECISION: tl.constexpr):
    """dc's tile sum_k dS_ijk, the heads inner; programs of tiles above the diagonal idle."""
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)
    n_block = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    if n_block * BLOCK_N < (m_block + 1) * BLOCK_M:  # some j <= i in the tile
        offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_e = tl.arange(0, BLOCK_E)
        offs_ev = tl.arange(0, BLOCK_EV)
        row_ok = offs_m < T
        own = tl.load(own_ptr).to(ACC)
        c = _c_tile(c_ptr, b, offs_m, offs_n, T, True, BLOCK_M, BLOCK_N, ACC)
        dc = tl.full((BLOCK_M, BLOCK_N), 0.0, ACC)
        for h in range(K):
            rows = (b * K + h) * T
            slope = tl.load(slopes_ptr + h).to(ACC)
            q, do, lse, delta = _query_side(q_ptr, do_ptr, lse_ptr, delta_ptr, rows, offs_m, T,
                                            E, EV, offs_e, offs_ev)
            k = _rows(k_ptr, rows, offs_n, T, E, offs_e)
            v = _rows(v_ptr, rows, offs_n, T, EV, offs_ev)
            p, ds = _p_and_ds(q, k, v, do, lse, delta, c, slope, own, offs_m, offs_n, T,
                              scale, ACC, PRECISION)
            dc += ds
        tl.store(dc_ptr + b * T * T + offs_m[:, None] * T + offs_n[None, :],
                 dc.to(dc_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (offs_n < T)[None, :])


# -- launching -------------------------------------------------------------------------------

def _acc(dtype: torch.dtype) -> tuple[torch.dtype, tl.dtype]:
    """The accumulation dtype for inputs of ``dtype``: fp64 for fp64, else fp32."""
    return (torch.float64, tl.float64) if dtype == torch.float64 else (torch.float32, tl.float32)


def _precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: full fp32 products for fp32 inputs (no TF32), as the math
    kernel computes them."""
    return "ieee" if dtype in (torch.float32, torch.float64) else "tf32"


def _width(n: int) -> int:
    """A tile width for n columns: the next power of two, at least 16 (tl.dot's minimum)."""
    return max(16, triton.next_power_of_2(n))


def default_block(e: int, ev: int) -> int:
    """Query and key tile size for rows of widths ``e`` (q, k) and ``ev`` (v): 64 for a head's
    width (<= 128), smaller for the rows that carry the per-head diagonal or the exact value
    path (d_model extra columns), whose tiles would not fit the GPU's registers."""
    widest = max(e, ev)
    return 64 if widest <= 128 else 32 if widest <= 256 else 16


def interpreted() -> bool:
    """Whether this process runs Triton kernels under Triton's interpreter (``TRITON_INTERPRET=1``
    when ``triton`` was first imported), the only way they run on CPU tensors."""
    return not isinstance(_forward_kernel, triton.runtime.jit.JITFunction)


def _check_device(t: Tensor) -> None:
    if t.device.type == "cpu" and not interpreted():
        raise RuntimeError("the Triton CEM attention kernel runs on CPU tensors only under "
                           "Triton's interpreter: set TRITON_INTERPRET=1 before triton is first "
                           "imported (or use CEMAttention.kernel 'math')")


def _launch_options(dtype: torch.dtype) -> dict:
    return {"ACC": _acc(dtype)[1], "PRECISION": _precision(dtype)}


@torch.library.custom_op("cemlab::cem_attention_forward", mutates_args=())
def _forward_op(q: Tensor, k: Tensor, v: Tensor, c: Tensor | None, slopes: Tensor, own: Tensor,
                scale: float, block: int) -> tuple[Tensor, Tensor]:
    _check_device(q)
    b, n_head, t, e = q.shape
    ev = v.shape[-1]
    o = torch.empty_like(v)
    lse = torch.empty(b, n_head, t, dtype=_acc(q.dtype)[0], device=q.device)
    _forward_kernel[(triton.cdiv(t, block), b * n_head)](  # without c, its pointer is unread
        q, k, v, q if c is None else c, slopes, own, o, lse, scale, t, n_head, e, ev,
        HAS_C=c is not None, BLOCK_M=block, BLOCK_N=block, BLOCK_E=_width(e),
        BLOCK_EV=_width(ev), **_launch_options(q.dtype))
    return o, lse


@_forward_op.register_fake
def _(q, k, v, c, slopes, own, scale, block):
    return torch.empty_like(v), q.new_empty(q.shape[:3], dtype=_acc(q.dtype)[0])


@torch.library.custom_op("cemlab::cem_attention_backward", mutates_args=())
def _backward_op(do: Tensor, q: Tensor, k: Tensor, v: Tensor, c: Tensor | None,
                 slopes: Tensor, own: Tensor, o: Tensor, lse: Tensor, scale: float, block: int
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    _check_device(q)
    b, n_head, t, e = q.shape
    ev = v.shape[-1]
    acc = _acc(q.dtype)[0]
    do = do.contiguous()
    delta = (do.to(acc) * o.to(acc)).sum(-1)  # (B, K, T)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    shapes = {"BLOCK_M": block, "BLOCK_N": block, "BLOCK_E": _width(e), "BLOCK_EV": _width(ev),
              **_launch_options(q.dtype)}
    grid = (triton.cdiv(t, block), b * n_head)
    c_arg = q if c is None else c  # without c, never read
    args = (q, k, v, do, lse, delta, c_arg, slopes, own)
    _backward_dq_kernel[grid](*args, dq, scale, t, n_head, e, ev, HAS_C=c is not None,
                              **shapes)
    _backward_dkv_kernel[grid](*args, dk, dv, scale, t, n_head, e, ev, HAS_C=c is not None,
                               **shapes)
    # d(b_self - b_cross) = sum over b, k, i of dS_iik = p_iik (dO_ik . v_ik - delta_ik)
    s_own = scale * (q.to(acc) * k.to(acc)).sum(-1) + own.to(acc)  # (B, K, T)
    if c is not None:
        s_own = s_own + c.diagonal(dim1=-2, dim2=-1).to(acc)[:, None]
    p_own = (s_own - lse).exp()
    d_own = (p_own * ((do.to(acc) * v.to(acc)).sum(-1) - delta)).sum().reshape(1)
    if c is None:
        return dq, dk, dv, q.new_empty(0), d_own.to(own.dtype)
    dc = torch.zeros_like(c)  # dL/dc: zero above the diagonal, where no program writes
    _backward_dc_kernel[(triton.cdiv(t, block), triton.cdiv(t, block), b)](
        *args, dc, scale, t, n_head, e, ev, **shapes)
    return dq, dk, dv, dc, d_own.to(own.dtype)


@_backward_op.register_fake
def _(do, q, k, v, c, slopes, own, o, lse, scale, block):
    dc = q.new_empty(0) if c is None else torch.empty_like(c)
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dc,
            torch.empty_like(own))


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, c, slopes, own, scale, block = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, c, slopes, own, o, lse)
    ctx.scale, ctx.block = scale, block


def _backward(ctx, do, _lse_grad):
    q, k, v, c, slopes, own, o, lse = ctx.saved_tensors
    dq, dk, dv, dc, d_own = _backward_op(do, q, k, v, c, slopes, own, o, lse, ctx.scale,
                                         ctx.block)
    return dq, dk, dv, None if c is None else dc, None, d_own, None, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def cem_attention(q: Tensor, k: Tensor, v: Tensor, slopes: Tensor, self_bias: Tensor,
                  cross_bias: Tensor, scale: float, cq: Tensor | None = None,
                  ck: Tensor | None = None, block: int | None = None) -> Tensor:
    """o_ik = sum_{j<=i} p_ijk v_jk, p_ijk = softmax_j(s_ijk), with (paper Eq. 1-5, App. A)

        s_ijk = scale q_ikᵀ k_jk + c_ij - m_k (i - j) + [i == j] b_self + [i != j] b_cross,
        c_ij = scale cq_iᵀ ck_j  (0 without ``cq``, ``ck``),

    the causal ALiBi scores of ``position.alibi_bias`` plus the shared KQ diagonal's scores
    (cq = D u, ck = h~), as the Triton kernels of this module compute them (the module
    docstring). Equal, up to rounding, to ``position.sdpa_math(q, k, v, bias + c, scale)``
    with ``bias = alibi_bias(slopes, T, self_bias, cross_bias)``.

    Shapes: ``q``, ``k`` (B, K, T, E); ``v`` (B, K, T, Ev); ``slopes`` m_k (K,) (no gradient);
    ``self_bias``, ``cross_bias`` (1,) (learnable); ``cq``, ``ck`` (B, T, Dc), both or neither;
    returns (B, K, T, Ev) in v's dtype. Gradients flow to q, k, v, cq, ck and both biases.
    ``block``: the query and key tile size (a power of two >= 16; default ``default_block``).
    q, k, v, cq and ck share one dtype (fp32 accumulation; fp64 for fp64) and one device;
    under autocast they are first cast to autocast's dtype.

    Raises:
        ValueError: mismatched shapes or dtypes, only one of ``cq``/``ck``, or a ``block``
            that is not a power of two >= 16.
        RuntimeError: CPU tensors without Triton's interpreter (``TRITON_INTERPRET=1``).
    """
    if (cq is None) != (ck is None):
        raise ValueError("cem_attention: give both cq and ck (the shared scores' factors), "
                         "or neither")
    if torch.is_autocast_enabled(q.device.type):  # the op itself is not autocast-aware
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        if cq is not None and ck is not None:
            cq, ck = cq.to(dtype), ck.to(dtype)
    b, n_head, t, e = q.shape
    if k.shape != q.shape or v.shape[:3] != q.shape[:3] or slopes.shape != (n_head,):
        raise ValueError(f"cem_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}, slopes {tuple(slopes.shape)} do not match")
    inputs = [q, k, v] + ([cq, ck] if cq is not None else [])
    if len({x.dtype for x in inputs}) != 1:
        raise ValueError("cem_attention: q, k, v, cq and ck must share one dtype, got "
                         f"{[x.dtype for x in inputs]}")
    if cq is not None and (cq.shape[:2] != (b, t) or ck.shape != cq.shape):
        raise ValueError(f"cem_attention: cq {tuple(cq.shape)} and ck {tuple(ck.shape)} must "
                         f"both be ({b}, {t}, Dc)")
    block = block or default_block(e, v.shape[-1])
    if block < 16 or block & (block - 1):
        raise ValueError(f"cem_attention: block must be a power of two >= 16, got {block}")
    own = (self_bias - cross_bias).to(_acc(q.dtype)[0]).reshape(1)
    c = None if cq is None else (scale * cq) @ ck.transpose(-1, -2)  # (B, T, T)
    return _forward_op(q.contiguous(), k.contiguous(), v.contiguous(), c,
                       slopes.to(own.dtype).contiguous(), own, float(scale), block)[0]


__all__ = ["cem_attention", "default_block", "interpreted"]
