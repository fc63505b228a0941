"""CEM attention's scores, softmax and weighted sum, forward and backward, as Triton kernels.

One step of CEM attention (paper Eq. 1-5, App. A; docs/DESIGN.md) attends, for every head k
and query i, over the keys j <= i with the scores

    s_ijk = scale q_ikᵀ k_jk + c_ij - m_k (i - j) + [i == j] b_self + [i != j] b_cross
    c_ij  = scale cq_iᵀ ck_j        (the shared KQ diagonal: cq = D u, ck = h~; else 0)

and returns o_ik = sum_j p_ijk v_jk, p = softmax_j s (``cem_attention``). The kernels:

* forward: one program per (sequence, query tile) runs all K heads in turn. Its first head
  computes each tile of c from cq and ck, for the key tiles at or below the diagonal only, and
  stores it; the other heads read it back (a (B, T, T) buffer in the accumulation dtype, its
  tiles at or below the diagonal written, that the backward reads again: c is computed once
  for every head). The query's own key is one more score of the diagonal
  tile: the learned biases enter as their difference b_self - b_cross at i == j (a constant
  over a row leaves the softmax unchanged), read once per program. It stores o and the
  log-sum-exp l_ik of the scores.
* backward, dq and dc: one program per (sequence, query tile), key tiles outer and heads
  inner: it recomputes p from l, forms dS_ijk = p_ijk (dp_ijk - delta_ik) with
  dp_ijk = dO_ikᵀ v_jk and delta_ik = dO_ikᵀ o_ik, adds the heads' dS into c's gradient
  dc_ij = sum_k dS_ijk in registers and stores each tile of it once; dq accumulates, in an
  fp32 buffer that only this program touches, over the key tiles (no atomic adds anywhere).
* backward, dk and dv: one program per (sequence, key tile), heads outer and query tiles
  inner, from the same recomputed p and dS.
* c's gradient to its factors: dcq = scale dc ck and dck = scale dcᵀ cq over the tiles at or
  below the diagonal only.

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
def _scores(q, k, c, slope, own, offs_m, offs_n, T, scale, HAS_C: tl.constexpr,
            ACC: tl.constexpr, PRECISION: tl.constexpr):
    """The tile of s (BLOCK_M, BLOCK_N) in ACC, -inf where j > i or j >= T."""
    s = tl.dot(q, tl.trans(k), out_dtype=ACC, input_precision=PRECISION) * scale
    if HAS_C:
        s += c
    diff = offs_m[:, None] - offs_n[None, :]
    s = s - slope * diff.to(ACC) + tl.where(diff == 0, own, 0.0).to(ACC)
    return tl.where((diff >= 0) & (offs_n < T)[None, :], s, float("-inf"))


@triton.jit
def _forward_kernel(q_ptr, k_ptr, v_ptr, cq_ptr, ck_ptr, slopes_ptr, own_ptr,
                    o_ptr, lse_ptr, c_ptr, scale, T, K, E, EV, DC,
                    HAS_C: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr, BLOCK_DC: tl.constexpr,
                    ACC: tl.constexpr, PRECISION: tl.constexpr):
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest (last) tiles first
    b = tl.program_id(1).to(tl.int64)
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_e = tl.arange(0, BLOCK_E)
    offs_ev = tl.arange(0, BLOCK_EV)
    offs_dc = tl.arange(0, BLOCK_DC)
    row_ok = offs_m < T
    own = tl.load(own_ptr).to(ACC)
    n_end = tl.minimum((m_block + 1) * BLOCK_M, T)
    c_rows = c_ptr + b * T * T + offs_m[:, None] * T
    for h in range(K):
        slope = tl.load(slopes_ptr + h).to(ACC)
        rows = (b * K + h) * T
        q = tl.load(q_ptr + (rows + offs_m)[:, None] * E + offs_e[None, :],
                    mask=row_ok[:, None] & (offs_e < E)[None, :], other=0.0)
        m_i = tl.full((BLOCK_M,), float("-inf"), ACC)
        l_i = tl.full((BLOCK_M,), 0.0, ACC)
        acc = tl.full((BLOCK_M, BLOCK_EV), 0.0, ACC)
        for n_start in range(0, n_end, BLOCK_N):
            offs_n = n_start + tl.arange(0, BLOCK_N)
            col_ok = offs_n < T
            k = tl.load(k_ptr + (rows + offs_n)[:, None] * E + offs_e[None, :],
                        mask=col_ok[:, None] & (offs_e < E)[None, :], other=0.0)
            c = tl.full((BLOCK_M, BLOCK_N), 0.0, ACC)
            if HAS_C:
                tile_ok = row_ok[:, None] & col_ok[None, :]
                if h == 0:  # c's tile, from cq and ck, once for all heads
                    for d in range(0, DC, BLOCK_DC):
                        d_ok = (d + offs_dc) < DC
                        cq = tl.load(cq_ptr + (b * T + offs_m)[:, None] * DC + d + offs_dc[None, :],
                                     mask=row_ok[:, None] & d_ok[None, :], other=0.0)
                        ck = tl.load(ck_ptr + (b * T + offs_n)[:, None] * DC + d + offs_dc[None, :],
                                     mask=col_ok[:, None] & d_ok[None, :], other=0.0)
                        c += tl.dot(cq, tl.trans(ck), out_dtype=ACC, input_precision=PRECISION)
                    c = c * scale
                    tl.store(c_rows + offs_n[None, :], c, mask=tile_ok)
                else:
                    c = tl.load(c_rows + offs_n[None, :], mask=tile_ok, other=0.0)
            s = _scores(q, k, c, slope, own, offs_m, offs_n, T, scale, HAS_C, ACC, PRECISION)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + (rows + offs_n)[:, None] * EV + offs_ev[None, :],
                        mask=col_ok[:, None] & (offs_ev < EV)[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, out_dtype=ACC,
                                                input_precision=PRECISION)
            m_i = m_new
        if HAS_C:
            tl.debug_barrier()  # the first head's stores of c, before the next head reads them
        o = acc / l_i[:, None]
        tl.store(o_ptr + (rows + offs_m)[:, None] * EV + offs_ev[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_ev < EV)[None, :])
        tl.store(lse_ptr + rows + offs_m, m_i + tl.log(l_i), mask=row_ok)


@triton.jit
def _p_and_ds(q, k, v, do, lse, delta, c, slope, own, offs_m, offs_n, T, scale,
              HAS_C: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr):
    """p and dS (BLOCK_M, BLOCK_N) in ACC, recomputed from the log-sum-exp; 0 where masked."""
    s = _scores(q, k, c, slope, own, offs_m, offs_n, T, scale, HAS_C, ACC, PRECISION)
    p = tl.where((offs_m < T)[:, None], tl.exp(s - lse[:, None]), 0.0)
    dp = tl.dot(do, tl.trans(v), out_dtype=ACC, input_precision=PRECISION)
    return p, p * (dp - delta[:, None])


@triton.jit
def _backward_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, c_ptr, slopes_ptr,
                        own_ptr, dq_ptr, dc_ptr, scale, T, K, E, EV,
                        HAS_C: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr,
                        ACC: tl.constexpr, PRECISION: tl.constexpr):
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest (last) tiles first
    b = tl.program_id(1).to(tl.int64)
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_e = tl.arange(0, BLOCK_E)
    offs_ev = tl.arange(0, BLOCK_EV)
    row_ok = offs_m < T
    q_mask = row_ok[:, None] & (offs_e < E)[None, :]
    own = tl.load(own_ptr).to(ACC)
    n_end = tl.minimum((m_block + 1) * BLOCK_M, T)
    for n_start in range(0, n_end, BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        col_ok = offs_n < T
        tile = b * T * T + offs_m[:, None] * T + offs_n[None, :]
        tile_ok = row_ok[:, None] & col_ok[None, :]
        c = tl.full((BLOCK_M, BLOCK_N), 0.0, ACC)
        if HAS_C:
            c = tl.load(c_ptr + tile, mask=tile_ok, other=0.0)
        dc = tl.full((BLOCK_M, BLOCK_N), 0.0, ACC)
        for h in range(K):
            slope = tl.load(slopes_ptr + h).to(ACC)
            rows = (b * K + h) * T
            q = tl.load(q_ptr + (rows + offs_m)[:, None] * E + offs_e[None, :], mask=q_mask,
                        other=0.0)
            do = tl.load(do_ptr + (rows + offs_m)[:, None] * EV + offs_ev[None, :],
                         mask=row_ok[:, None] & (offs_ev < EV)[None, :], other=0.0)
            lse = tl.load(lse_ptr + rows + offs_m, mask=row_ok, other=0.0)
            delta = tl.load(delta_ptr + rows + offs_m, mask=row_ok, other=0.0)
            k = tl.load(k_ptr + (rows + offs_n)[:, None] * E + offs_e[None, :],
                        mask=col_ok[:, None] & (offs_e < E)[None, :], other=0.0)
            v = tl.load(v_ptr + (rows + offs_n)[:, None] * EV + offs_ev[None, :],
                        mask=col_ok[:, None] & (offs_ev < EV)[None, :], other=0.0)
            p, ds = _p_and_ds(q, k, v, do, lse, delta, c, slope, own, offs_m, offs_n, T, scale,
                              HAS_C, ACC, PRECISION)
            dc += ds
            dq_at = dq_ptr + (rows + offs_m)[:, None] * E + offs_e[None, :]
            dq = tl.load(dq_at, mask=q_mask, other=0.0)
            dq += scale * tl.dot(ds.to(k.dtype), k, out_dtype=ACC, input_precision=PRECISION)
            tl.store(dq_at, dq, mask=q_mask)
        if HAS_C:
            tl.store(dc_ptr + tile, dc, mask=tile_ok)
        tl.debug_barrier()  # this program's dq stores, before its next key tile reads them


@triton.jit
def _backward_dkv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, c_ptr, slopes_ptr,
                         own_ptr, dk_ptr, dv_ptr, scale, T, K, E, EV,
                         HAS_C: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr,
                         ACC: tl.constexpr, PRECISION: tl.constexpr):
    n_block = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_e = tl.arange(0, BLOCK_E)
    offs_ev = tl.arange(0, BLOCK_EV)
    col_ok = offs_n < T
    k_mask = col_ok[:, None] & (offs_e < E)[None, :]
    v_mask = col_ok[:, None] & (offs_ev < EV)[None, :]
    own = tl.load(own_ptr).to(ACC)
    m_begin = (n_block * BLOCK_N // BLOCK_M) * BLOCK_M  # the first query tile with a row >= j
    for h in range(K):
        slope = tl.load(slopes_ptr + h).to(ACC)
        rows = (b * K + h) * T
        k = tl.load(k_ptr + (rows + offs_n)[:, None] * E + offs_e[None, :], mask=k_mask,
                    other=0.0)
        v = tl.load(v_ptr + (rows + offs_n)[:, None] * EV + offs_ev[None, :], mask=v_mask,
                    other=0.0)
        dk = tl.full((BLOCK_N, BLOCK_E), 0.0, ACC)
        dv = tl.full((BLOCK_N, BLOCK_EV), 0.0, ACC)
        for m_start in range(m_begin, T, BLOCK_M):
            offs_m = m_start + tl.arange(0, BLOCK_M)
            row_ok = offs_m < T
            c = tl.full((BLOCK_M, BLOCK_N), 0.0, ACC)
            if HAS_C:
                c = tl.load(c_ptr + b * T * T + offs_m[:, None] * T + offs_n[None, :],
                            mask=row_ok[:, None] & col_ok[None, :], other=0.0)
            q = tl.load(q_ptr + (rows + offs_m)[:, None] * E + offs_e[None, :],
                        mask=row_ok[:, None] & (offs_e < E)[None, :], other=0.0)
            do = tl.load(do_ptr + (rows + offs_m)[:, None] * EV + offs_ev[None, :],
                         mask=row_ok[:, None] & (offs_ev < EV)[None, :], other=0.0)
            lse = tl.load(lse_ptr + rows + offs_m, mask=row_ok, other=0.0)
            delta = tl.load(delta_ptr + rows + offs_m, mask=row_ok, other=0.0)
            p, ds = _p_and_ds(q, k, v, do, lse, delta, c, slope, own, offs_m, offs_n, T, scale,
                              HAS_C, ACC, PRECISION)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, out_dtype=ACC, input_precision=PRECISION)
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, out_dtype=ACC, input_precision=PRECISION)
        tl.store(dk_ptr + (rows + offs_n)[:, None] * E + offs_e[None, :],
                 (scale * dk).to(dk_ptr.dtype.element_ty), mask=k_mask)
        tl.store(dv_ptr + (rows + offs_n)[:, None] * EV + offs_ev[None, :],
                 dv.to(dv_ptr.dtype.element_ty), mask=v_mask)


@triton.jit
def _c_factor_grad_kernel(dc_ptr, x_ptr, out_ptr, scale, T, DC,
                          TRANSPOSED: tl.constexpr, BLOCK_T: tl.constexpr,
                          BLOCK_DC: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr):
    """out_r = scale sum_j dc_rj x_j (``TRANSPOSED``: scale sum_i dc_ir x_i) over the entries
    at or below the diagonal; one program per (sequence, row tile, column chunk of DC)."""
    r_block = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_DC
    b = tl.program_id(2).to(tl.int64)
    offs_r = r_block * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = d + tl.arange(0, BLOCK_DC)
    r_ok = offs_r < T
    d_ok = offs_d < DC
    out = tl.full((BLOCK_T, BLOCK_DC), 0.0, ACC)
    if TRANSPOSED:  # r = j: the query tiles i >= j
        begin = r_block * BLOCK_T
        end = T
    else:  # r = i: the key tiles j <= i
        begin = 0
        end = tl.minimum((r_block + 1) * BLOCK_T, T)
    for start in range(begin, end, BLOCK_T):
        offs_s = start + tl.arange(0, BLOCK_T)
        s_ok = offs_s < T
        x = tl.load(x_ptr + (b * T + offs_s)[:, None] * DC + offs_d[None, :],
                    mask=s_ok[:, None] & d_ok[None, :], other=0.0).to(ACC)
        if TRANSPOSED:  # the tile dc[s, r] (rows i = s, columns j = r), read row-major
            keep = (offs_s[:, None] >= offs_r[None, :]) & s_ok[:, None] & r_ok[None, :]
            dc = tl.load(dc_ptr + b * T * T + offs_s[:, None] * T + offs_r[None, :],
                         mask=keep, other=0.0)
            out += tl.dot(tl.trans(dc), x, out_dtype=ACC, input_precision=PRECISION)
        else:
            keep = (offs_s[None, :] <= offs_r[:, None]) & s_ok[None, :] & r_ok[:, None]
            dc = tl.load(dc_ptr + b * T * T + offs_r[:, None] * T + offs_s[None, :],
                         mask=keep, other=0.0)
            out += tl.dot(dc, x, out_dtype=ACC, input_precision=PRECISION)
    tl.store(out_ptr + (b * T + offs_r)[:, None] * DC + offs_d[None, :],
             (scale * out).to(out_ptr.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])


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
def _forward_op(q: Tensor, k: Tensor, v: Tensor, cq: Tensor | None, ck: Tensor | None,
                slopes: Tensor, own: Tensor, scale: float, block: int
                ) -> tuple[Tensor, Tensor, Tensor]:
    _check_device(q)
    b, n_head, t, e = q.shape
    ev = v.shape[-1]
    acc = _acc(q.dtype)[0]
    o = torch.empty_like(v)
    lse = torch.empty(b, n_head, t, dtype=acc, device=q.device)
    has_c = cq is not None
    c = (torch.empty(b, t, t, dtype=acc, device=q.device) if has_c
         else torch.empty(0, dtype=acc, device=q.device))
    dc_width = cq.shape[-1] if has_c else 1
    _forward_kernel[(triton.cdiv(t, block), b)](  # without c, its pointers are never read
        q, k, v, cq if has_c else q, ck if has_c else q, slopes, own, o, lse, c if has_c else lse,
        scale, t, n_head, e, ev, dc_width, HAS_C=has_c, BLOCK_M=block, BLOCK_N=block,
        BLOCK_E=_width(e), BLOCK_EV=_width(ev), BLOCK_DC=min(64, _width(dc_width)),
        **_launch_options(q.dtype))
    return o, lse, c


@_forward_op.register_fake
def _(q, k, v, cq, ck, slopes, own, scale, block):
    b, n_head, t, _ = q.shape
    acc = _acc(q.dtype)[0]
    c_shape = (b, t, t) if cq is not None else (0,)
    return (torch.empty_like(v), q.new_empty((b, n_head, t), dtype=acc),
            q.new_empty(c_shape, dtype=acc))


@torch.library.custom_op("cemlab::cem_attention_backward", mutates_args=())
def _backward_op(do: Tensor, q: Tensor, k: Tensor, v: Tensor, cq: Tensor | None,
                 ck: Tensor | None, slopes: Tensor, own: Tensor, o: Tensor, lse: Tensor,
                 c: Tensor, scale: float, block: int
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    _check_device(q)
    b, n_head, t, e = q.shape
    ev = v.shape[-1]
    acc = _acc(q.dtype)[0]
    do = do.contiguous()
    has_c = cq is not None
    delta = (do.to(acc) * o.to(acc)).sum(-1)  # (B, K, T)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    dc = torch.empty(b, t, t, dtype=acc, device=q.device) if has_c else None  # dL/dc
    options = _launch_options(q.dtype)
    shapes = {"HAS_C": has_c, "BLOCK_M": block, "BLOCK_N": block, "BLOCK_E": _width(e),
              "BLOCK_EV": _width(ev), **options}
    grid = (triton.cdiv(t, block), b)
    c_arg, dc_arg = (c, dc) if has_c else (lse, delta)  # without c, never read
    _backward_dq_kernel[grid](q, k, v, do, lse, delta, c_arg, slopes, own, dq, dc_arg, scale, t,
                              n_head, e, ev, **shapes)
    _backward_dkv_kernel[grid](q, k, v, do, lse, delta, c_arg, slopes, own, dk, dv, scale, t,
                               n_head, e, ev, **shapes)
    # d(b_self - b_cross) = sum over b, k, i of dS_iik = p_iik (dO_ik . v_ik - delta_ik)
    s_own = scale * (q.to(acc) * k.to(acc)).sum(-1) + own.to(acc)  # (B, K, T)
    if has_c:
        s_own = s_own + c.diagonal(dim1=-2, dim2=-1)[:, None]
    p_own = (s_own - lse).exp()
    d_own = (p_own * ((do.to(acc) * v.to(acc)).sum(-1) - delta)).sum().reshape(1)
    if not has_c:
        empty = q.new_empty(0)
        return dq.to(q.dtype), dk, dv, empty, empty.clone(), d_own.to(own.dtype)
    dc_width = cq.shape[-1]
    block_dc = min(64, _width(dc_width))
    grid_c = (triton.cdiv(t, block), triton.cdiv(dc_width, block_dc), b)
    dcq, dck = torch.empty_like(cq), torch.empty_like(ck)
    for out, factor, transposed in ((dcq, ck, False), (dck, cq, True)):
        _c_factor_grad_kernel[grid_c](dc, factor, out, scale, t, dc_width, TRANSPOSED=transposed,
                                      BLOCK_T=block, BLOCK_DC=block_dc, **options)
    return dq.to(q.dtype), dk, dv, dcq, dck, d_own.to(own.dtype)


@_backward_op.register_fake
def _(do, q, k, v, cq, ck, slopes, own, o, lse, c, scale, block):
    if cq is None:
        dcq = dck = q.new_empty(0)
    else:
        dcq, dck = torch.empty_like(cq), torch.empty_like(ck)
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dcq, dck,
            torch.empty_like(own))


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, cq, ck, slopes, own, scale, block = inputs
    o, lse, c = output
    ctx.save_for_backward(q, k, v, cq, ck, slopes, own, o, lse, c)
    ctx.scale, ctx.block = scale, block


def _backward(ctx, do, _lse_grad, _c_grad):
    q, k, v, cq, ck, slopes, own, o, lse, c = ctx.saved_tensors
    dq, dk, dv, dcq, dck, d_own = _backward_op(do, q, k, v, cq, ck, slopes, own, o, lse, c,
                                               ctx.scale, ctx.block)
    has_c = cq is not None
    return (dq, dk, dv, dcq if has_c else None, dck if has_c else None, None, d_own, None,
            None)


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
    acc = _acc(q.dtype)[0]
    own = (self_bias - cross_bias).to(acc).reshape(1)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if cq is not None:
        cq, ck = cq.contiguous(), ck.contiguous()
    return _forward_op(q, k, v, cq, ck, slopes.to(acc).contiguous(), own, float(scale),
                       block)[0]


__all__ = ["cem_attention", "default_block", "interpreted"]
