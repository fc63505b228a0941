"""Learned lightweight preconditioners P of the CEM updates (paper Sec. 2.3, App. C.4)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class Preconditioner(nn.Module):
    """``groups`` independent D x D preconditioners (one per attention head, or one for the MLP).

    kind ``diag``: P = diag(softplus(d)); ``diag_lowrank``: P = diag(softplus(d)) + UVᵀ + VUᵀ,
    or with ``psd`` P = diag(softplus(d)) + UUᵀ (positive definite by construction). U, V are
    D x ``rank``. Initialisation (App. C.4): d = sqrt(D) p with p = 1/sqrt(D) (so d = 1, and
    P = softplus(1) I = 1.31 I), or with ``init="unit"`` d = softplus^-1(1) (P = I);
    U ~ N(0, 0.02^2), V = 0.

    Parameters ``p`` (groups, D), ``lowrank_u``/``lowrank_v`` (groups, D, rank).
    """

    def __init__(self, kind: str, dim: int, rank: int, groups: int = 1, psd: bool = False,
                 init: str = "softplus1") -> None:
        super().__init__()
        if kind not in ("diag", "diag_lowrank"):
            raise ValueError(f"unknown preconditioner kind {kind!r}")
        self.kind, self.dim, self.psd = kind, dim, psd
        d0 = {"softplus1": 1.0, "unit": math.log(math.e - 1)}[init]  # softplus(d0) = 1.31 or 1
        self.p = nn.Parameter(torch.full((groups, dim), d0 / math.sqrt(dim)))
        if kind == "diag_lowrank":
            self.lowrank_u = nn.Parameter(torch.randn(groups, dim, rank) * 0.02)
            if not psd:
                self.lowrank_v = nn.Parameter(torch.zeros(groups, dim, rank))

    def diagonal(self) -> torch.Tensor:
        """softplus(d), shape (groups, D)."""
        return F.softplus(math.sqrt(self.dim) * self.p)

    def forward(self, g: torch.Tensor) -> torch.Tensor:
        """P_k g_k for ``g`` of shape (..., groups, D); returns the same shape."""
        out = self.diagonal() * g
        if self.kind == "diag_lowrank":
            u = self.lowrank_u
            ug = torch.einsum("...gd,gdr->...gr", g, u)  # Uᵀ g
            if self.psd:
                out = out + torch.einsum("...gr,gdr->...gd", ug, u)
            else:
                v = self.lowrank_v
                vg = torch.einsum("...gd,gdr->...gr", g, v)  # Vᵀ g
                out = (out + torch.einsum("...gr,gdr->...gd", vg, u)
                       + torch.einsum("...gr,gdr->...gd", ug, v))
        return out

    def matrix(self) -> torch.Tensor:
        """The dense preconditioners, shape (groups, D, D)."""
        eye = torch.eye(self.dim, dtype=self.p.dtype, device=self.p.device)
        return self(eye[:, None, :].expand(self.dim, self.p.shape[0], self.dim)).permute(1, 2, 0)

    def min_eigenvalue(self) -> torch.Tensor:
        """Smallest eigenvalue of each (symmetric) P, shape (groups,): P > 0 iff all positive."""
        return torch.linalg.eigvalsh(self.matrix().double())[:, 0]
