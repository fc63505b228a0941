"""The CEM energies (paper Eq. 1 with diagonal and ALiBi bias, App. A; Eq. 7).

Both are energies of the query-side variable ``u = norm(x)`` given the fixed, normalised block
input ``h~``; the CEM sublayers descend them (``x <- x - eta P grad_u``).
"""

from __future__ import annotations

import math

import torch

_PI2_12 = math.pi**2 / 12
_TAYLOR_BELOW = 0.5  # |x| below this: Taylor series of phi (the closed form cancels to ~0)
_SERIES_TERMS = 80  # Li2(-r) = sum_k (-1)^k r^k / k^2 with r = e^-|x| <= e^-0.5: 80 terms < 1e-17


def _li2_neg_exp(a: torch.Tensor) -> torch.Tensor:
    """Li2(-e^-a) for a >= _TAYLOR_BELOW, by its alternating power series in r = e^-a."""
    r = torch.exp(-a)
    total, power = torch.zeros_like(a), torch.ones_like(a)
    for k in range(1, _SERIES_TERMS + 1):
        power = power * -r
        total = total + power / (k * k)
    return total


def _phi(x: torch.Tensor) -> torch.Tensor:
    a = x.abs().clamp_min(_TAYLOR_BELOW)
    li2 = _li2_neg_exp(a)  # Li2(-e^-|x|)
    # x <= 0: phi = x softplus(x) + Li2(-e^x) + pi^2/12
    # x > 0 (Li2 inversion: Li2(-e^x) = -pi^2/6 - x^2/2 - Li2(-e^-x)), with
    #   softplus(x) = x + softplus(-x): phi = x^2/2 + x softplus(-x) - pi^2/12 - Li2(-e^-x)
    neg = x * torch.nn.functional.softplus(x) + li2 + _PI2_12
    pos = 0.5 * x * x + x * torch.nn.functional.softplus(-x) - _PI2_12 - li2
    x2 = x * x
    # SiLU(z) = z/2 + z^2/4 - z^4/48 + z^6/480 - 17 z^8/80640 + 31 z^10/1451520 - ...
    taylor = x2 * (1 / 4 + x * (1 / 12 + x2 * (-1 / 240 + x2 * (
        1 / 3360 + x2 * (-17 / 725760 + x2 * 31 / 15966720)))))
    return torch.where(x.abs() < _TAYLOR_BELOW, taylor, torch.where(x > 0, pos, neg))


class _SiluIntegral(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return _phi(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad * torch.nn.functional.silu(x)


def silu_integral(x: torch.Tensor) -> torch.Tensor:
    """phi(x) = int_0^x SiLU(z) dz = x softplus(x) + Li2(-e^x) + pi^2/12 (element-wise).

    Evaluated stably: the Taylor series for |x| < 0.5, otherwise the closed form through the
    series of Li2(-e^-|x|) (with the inversion formula for x > 0). Accurate to float32
    rounding for |x| <= 40. Its autograd derivative is exactly SiLU(x).
    """
    return _SiluIntegral.apply(x)


def interaction_scores(u: torch.Tensor, h_norm: torch.Tensor, w_q: torch.Tensor,
                       w_k: torch.Tensor, diag: torch.Tensor | None, bias: torch.Tensor,
                       ) -> torch.Tensor:
    """Scores s_ijk = (k_jᵀ q_i + h~_jᵀ D_k u_i) / tau + b_ijk, shape (B, K, T, T).

    ``u``, ``h_norm`` (B, T, D); ``w_q``, ``w_k`` (K, Dh, D); ``diag`` None, (D,) shared or
    (K, D) per head; ``bias`` (K, T, T) with -inf above the diagonal; tau = sqrt(Dh).
    """
    tau = math.sqrt(w_q.shape[1])
    q = torch.einsum("kcd,btd->bktc", w_q, u)
    k = torch.einsum("kcd,btd->bktc", w_k, h_norm)
    s = q @ k.transpose(-1, -2)
    if diag is not None:
        du = u[:, None] * (diag if diag.dim() == 2 else diag[None])[None, :, None, :]  # (B,K,T,D)
        s = s + du @ h_norm[:, None].transpose(-1, -2)
    return s / tau + bias


def interaction_energy(u: torch.Tensor, h_norm: torch.Tensor, w_q: torch.Tensor,
                       w_k: torch.Tensor, diag: torch.Tensor | None, bias: torch.Tensor,
                       per_head: bool = False) -> torch.Tensor:
    """eps(u_i | h~_{1:i}) = -tau sum_k log sum_{j<=i} exp(s_ijk) (Eq. 1, App. A).

    Arguments as ``interaction_scores``. Returns (B, T), or (B, T, K) per head with ``per_head``.
    Its gradient in u_i is -sum_k sum_j p_ijk beta_kj with beta_kj = W^Qᵀ_k k_j + D_k h~_j.
    """
    tau = math.sqrt(w_q.shape[1])
    e = -tau * torch.logsumexp(interaction_scores(u, h_norm, w_q, w_k, diag, bias), dim=-1)
    e = e.transpose(1, 2)  # (B, T, K)
    return e if per_head else e.sum(-1)


def elementwise_energy(u: torch.Tensor, gamma: torch.Tensor, w_v: torch.Tensor) -> torch.Tensor:
    """xi(u_i | h_i) = -gamma_iᵀ phi(V u_i) (Eq. 7), phi = int SiLU; shape (B, T).

    ``u`` (B, T, D), ``gamma = W h~`` (B, T, d_mlp), ``w_v`` = V (d_mlp, D).
    """
    return -(gamma * silu_integral(u @ w_v.T)).sum(-1)
