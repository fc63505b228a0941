"""The gradient of CEM attention's shared-diagonal scores as one Triton kernel (GPU only).

FlexAttention differentiates a tensor that its ``score_mod`` reads by an atomic add from every
score: the shared diagonal's scores c_ij (B, T, T), read by every head, took 12 atomic adds per
entry per layer, and their reads and adds doubled the kernel's time at ``llama-134m`` on an H200
(0.53 ms forward and 1.23 ms backward per call, against 0.22 and 0.55 ms without them). Here one
program owns a (query block, key block) tile of one sequence, loops over the heads and sums their
score gradients in registers, and writes the tile once: no atomics, c read once, G written once.
It recomputes each head's scores and dO vᵀ (two of the five products of an attention backward).

Importing this module imports Triton; ``models.flex`` imports it only for CUDA tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton


@triton.autotune(
    configs=[triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
             for m, n, w, s in ((64, 64, 4, 2), (128, 64, 4, 2), (64, 128, 4, 2),
                                (128, 128, 8, 2))],
    key=["T", "E", "EV"])
@triton.jit
def _shared_score_grad_kernel(Q, K, V, DO, LSE, DELTA, SLOPES, C, G, scale, T,
                              sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t,
                              sd_b, sd_h, sd_t, sl_b, sl_h, sc_b, sc_t, sg_b, sg_t,
                              H: tl.constexpr, E: tl.constexpr, EV: tl.constexpr,
                              PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr):
    pid_m, pid_n, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_range = (rows[:, None] < T) & (cols[None, :] < T)
    g_ptrs = G + b * sg_b + rows[:, None] * sg_t + cols[None, :]
    if pid_n * BLOCK_N >= (pid_m + 1) * BLOCK_M:  # every key after every query: no gradient
        tl.store(g_ptrs, tl.zeros((BLOCK_M, BLOCK_N), tl.float32), mask=in_range)
        return
    before = (cols[None, :] < rows[:, None]) & in_range  # the kernel's keys j < i
    e, ev = tl.arange(0, E), tl.arange(0, EV)
    c = tl.load(C + b * sc_b + rows[:, None] * sc_t + cols[None, :], mask=before, other=0.0)
    distance = (rows[:, None] - cols[None, :]).to(tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for h in range(H):
        q = tl.load(Q + b * sq_b + h * sq_h + rows[:, None] * sq_t + e[None, :],
                    mask=rows[:, None] < T, other=0.0)
        k = tl.load(K + b * sk_b + h * sk_h + cols[:, None] * sk_t + e[None, :],
                    mask=cols[:, None] < T, other=0.0)
        do = tl.load(DO + b * sd_b + h * sd_h + rows[:, None] * sd_t + ev[None, :],
                     mask=rows[:, None] < T, other=0.0)
        v = tl.load(V + b * sv_b + h * sv_h + cols[:, None] * sv_t + ev[None, :],
                    mask=cols[:, None] < T, other=0.0)
        lse = tl.load(LSE + b * sl_b + h * sl_h + rows, mask=rows < T, other=0.0)
        delta = tl.load(DELTA + b * sl_b + h * sl_h + rows, mask=rows < T, other=0.0)
        slope = tl.load(SLOPES + h).to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        s = (qk * scale).to(tl.float32) - slope * distance + c  # Inductor passes scale as fp64
        p = tl.where(before, tl.exp(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        acc += p * (dp - delta[:, None])
    tl.store(g_ptrs, acc, mask=in_range)


@triton_op("cemlab::shared_score_grad", mutates_args={})
def shared_score_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d_out: torch.Tensor,
                      lse: torch.Tensor, delta: torch.Tensor, slopes: torch.Tensor,
                      shared_scores: torch.Tensor, scale: float) -> torch.Tensor:
    """G_bij = sum_k p_ijk (dO'_ik · v_jk - delta_ik) over j < i, else 0: see
    ``models.flex.shared_score_grad_reference`` (the same quantity, written out in torch).

    ``q``, ``k`` (B, K, T, E), ``v``, ``d_out`` (B, K, T, Ev), each row contiguous; ``lse``,
    ``delta`` (B, K, T) fp32; ``slopes`` (K,); ``shared_scores`` (B, T, T) fp32 -> (B, T, T)
    fp32. E and Ev: powers of two, at least 16 (``tl.dot``'s tiles). fp32 products in full
    precision (no TF32), as FlexAttention's own under torch's defaults.
    """
    b, n_head, t, e = q.shape
    ev = v.shape[-1]
    lse, delta = lse.contiguous(), delta.contiguous()
    grad = torch.empty((b, t, t), device=q.device, dtype=torch.float32)

    def grid(meta):
        return triton.cdiv(t, meta["BLOCK_M"]), triton.cdiv(t, meta["BLOCK_N"]), b

    wrap_triton(_shared_score_grad_kernel)[grid](
        q, k, v, d_out, lse, delta, slopes, shared_scores, grad, scale, t,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), d_out.stride(0), d_out.stride(1),
        d_out.stride(2), lse.stride(0), lse.stride(1), shared_scores.stride(0),
        shared_scores.stride(1), grad.stride(0), grad.stride(1), H=n_head, E=e, EV=ev,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32")  # fp32 as FlexAttention's
    return grad
