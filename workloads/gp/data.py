"""Regression data drawn from Gaussian processes (paper App. D): a stationary RBF kernel and a
non-stationary Gibbs kernel over inputs in ``input_dim`` dimensions."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

Kernel = Literal["rbf", "nonstationary"]


def rbf_kernel(x: torch.Tensor, lengthscale: float) -> torch.Tensor:
    """k(x, x') = exp(-|x - x'|² / (2 l²)); ``x`` (N, d) -> (N, N)."""
    return torch.exp(-torch.cdist(x, x).square() / (2 * lengthscale**2))


def gibbs_kernel(x: torch.Tensor, lengthscale: float) -> torch.Tensor:
    """Gibbs' non-stationary kernel with an input-dependent length scale
    l(x) = lengthscale * exp(mean(x) / 2):

        k(x, x') = (2 l(x) l(x') / (l(x)² + l(x')²))^(d/2) exp(-|x - x'|² / (l(x)² + l(x')²))

    positive semi-definite for any positive l(x). ``x`` (N, d) -> (N, N).
    """
    ell = lengthscale * torch.exp(x.mean(dim=1) / 2)  # (N,)
    sq = ell[:, None] ** 2 + ell[None, :] ** 2
    prefactor = (2 * ell[:, None] * ell[None, :] / sq) ** (x.shape[1] / 2)
    return prefactor * torch.exp(-torch.cdist(x, x).square() / sq)


@dataclass(frozen=True)
class GPData:
    """Inputs ``x`` (N, d) and noisy targets ``y`` (N,) per split, float32."""

    x: dict[str, torch.Tensor]
    y: dict[str, torch.Tensor]
    noise_std: float


def sample_gp_regression(kernel: Kernel, input_dim: int, n_train: int, n_val: int, n_test: int,
                         noise_std: float, seed: int) -> GPData:
    """One function f ~ GP(0, k) sampled jointly at x ~ N(0, I) for all splits, y = f + noise.

    The length scale is sqrt(input_dim), so typical inputs are about one length scale apart.
    Deterministic in its arguments (float64 Cholesky with jitter on a private generator).

    Raises:
        ValueError: an unknown ``kernel``.
    """
    if kernel not in ("rbf", "nonstationary"):
        raise ValueError(f"kernel must be 'rbf' or 'nonstationary', got {kernel!r}")
    g = torch.Generator().manual_seed(seed)
    n = n_train + n_val + n_test
    x = torch.randn(n, input_dim, generator=g, dtype=torch.float64)
    k = (rbf_kernel if kernel == "rbf" else gibbs_kernel)(x, math.sqrt(input_dim))
    chol = torch.linalg.cholesky(k + 1e-6 * torch.eye(n, dtype=torch.float64))
    f = chol @ torch.randn(n, generator=g, dtype=torch.float64)
    y = f + noise_std * torch.randn(n, generator=g, dtype=torch.float64)
    bounds = {"train": (0, n_train), "validation": (n_train, n_train + n_val),
              "test": (n_train + n_val, n)}
    return GPData(x={s: x[a:b].float() for s, (a, b) in bounds.items()},
                  y={s: y[a:b].float() for s, (a, b) in bounds.items()}, noise_std=noise_std)
