"""CEM sublayers: weight-tied attention and MLP as descent on explicit energies.

Each sublayer takes the residual stream ``h`` (B, T, D) and returns the last iterate ``x^(T)``;
the residual is absorbed into the update. Each owns one RMSNorm ``norm``, applied to ``h`` for
the fixed side (keys/values, gamma; ``fixed_input: h`` skips it there) and to every iterate for
the query side (paper Algorithm 1, as reconstructed in docs/DESIGN.md).
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from workloads.core.architecture import ModelConfig
from workloads.models.energy import elementwise_energy, interaction_energy
from workloads.models.flex import alibi_flex_attention
from workloads.models.position import alibi_bias, alibi_slopes, sdpa_mask, sdpa_math
from workloads.models.precond import Preconditioner

VELOCITY = "attn_velocity"  # key of the attention velocity in a layer-scope momentum carry
KERNELS = ("auto", "sdpa", "math", "explicit", "flex", "triton")  # CEMAttention.kernel's values


def _kernel_from_env() -> str:
    """``CEMLAB_CEM_KERNEL``, the default of ``CEMAttention.kernel`` in this process (and the
    Ray workers it starts), read at import; ``auto`` when unset.

    Raises:
        ValueError: the variable is set to a value not in ``KERNELS``.
    """
    kernel = os.environ.get("CEMLAB_CEM_KERNEL", "").strip() or "auto"
    if kernel not in KERNELS:
        raise ValueError(f"CEMLAB_CEM_KERNEL: expected one of {KERNELS}, got {kernel!r}")
    return kernel


def _fixed_input(sub: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """The fixed side's input h~ (B, T, D): ``sub.norm(h)``, or ``h`` itself with
    ``fixed_input: h``."""
    return sub.norm(h) if sub.cfg.fixed_input == "norm_h" else h


def _step_size(value: float, learnable: bool) -> torch.Tensor | float:
    # Shape (1,), not 0-dim: DeepSpeed's bf16 path cannot flatten 0-dim parameters.
    return nn.Parameter(torch.tensor([value])) if learnable else value


class CEMAttention(nn.Module):
    """Weight-tied attention: descent on the interaction energy (Eq. 1-5, Sec. 2.3, App. A).

    With ``h~ = norm(h)``, keys (= values) ``k_j = W^K h~_j`` are computed once; for each step
    ``u = norm(x)``, ``q_i = W^Q u_i`` and

        s_ijk = (k_jᵀ q_i + h~_jᵀ D_k u_i) / tau - m_k (i - j) + [i == j] b_self + [i != j] b_cross
        g_ik  = W^Q_kᵀ sum_j p_ijk k_j  (+ D_k sum_j p_ijk h~_j  with energy_exact)
        x_i  <- x_i + eta sum_k P_k g_ik                     (p = softmax_j s, tau = sqrt(Dh))

    (``attn_precond_placement: shared``: x_i <- x_i + eta P sum_k g_ik, one P for all heads.)

    With ``energy_exact`` (or no diagonal) sum_k g_ik = -grad_u eps(u | h~) of
    ``workloads.models.energy.interaction_energy``; Algorithm 1 (the default) drops the D_k h~
    value term. ``update`` replaces the plain step by heavy-ball momentum, Nesterov, or the
    Newton-type step (see ``newton_correction``). With ``layer_reuse`` the sublayer is instead
    applied T times as a plain residual layer, keys recomputed from each new state.

    Parameters: ``q_proj`` (W^Q, D -> K*Dh, also the output map W^Qᵀ, Eq. 5), ``k_proj`` (W^K,
    also the value map), ``self_bias``/``cross_bias`` (1,), ``kq_diag`` (D,) shared or (K, D)
    per head, ``step_size`` (1,) when learnable, ``precond`` (a ``Preconditioner`` per head, or
    one shared);
    buffer ``alibi_slopes`` (K,). Input and output (B, T, D).
    """

    # How the scores become outputs: ``sdpa`` (torch's scaled_dot_product_attention with the bias as
    # its float mask; on a CPU with a bias that needs a gradient, its math kernel written out,
    # ``sdpa_math``), ``math`` (``sdpa_math`` always: plain ops, which ``torch.func.vmap`` batches
    # for stacked trials), ``explicit`` (scores, softmax and the weighted sum as three ops: the
    # reference), ``flex`` (FlexAttention, the bias a score_mod: ``models.flex``) or ``auto``: flex
    # to train on a GPU, sdpa elsewhere (FlexAttention has no CPU backward; see ``uses_flex``), or
    # ``triton`` (the Triton kernels of ``models.kernels.cem_attention``, forward and backward, the
    # shared diagonal's scores one batched matrix product that every head's kernel reads; on a CPU
    # only under Triton's interpreter). The Newton step needs the probabilities, so it takes sdpa's
    # (explicit) path whatever is set. The default is ``CEMLAB_CEM_KERNEL`` (``auto`` unset). In
    # bf16 on a CPU, ``explicit`` is the fastest, but it rounds the scores to bf16 before the
    # softmax, which SDPA (like the fused kernel of Llama's attention) does not, a numerical
    # difference between the variants compared: it is not the default (docs/benchmarks.md).
    kernel: str = _kernel_from_env()

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.n_head, self.d_head = cfg.n_head, cfg.d_head
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_head * cfg.d_head, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.n_head * cfg.d_head, bias=False)
        self.self_bias = nn.Parameter(torch.zeros(1))
        self.cross_bias = nn.Parameter(torch.zeros(1))
        self.register_buffer("alibi_slopes", alibi_slopes(cfg.n_head), persistent=False)
        diag_shape = {"none": None, "shared": (cfg.d_model,),
                      "per_head": (cfg.n_head, cfg.d_model)}[cfg.kq_diag]
        self.kq_diag = nn.Parameter(torch.zeros(diag_shape)) if diag_shape else None
        self.step_size = _step_size(cfg.attn_step_size, cfg.learn_step_size)
        self.shared_precond = cfg.attn_precond_placement == "shared"
        self.precond = (None if cfg.attn_preconditioner == "identity" else Preconditioner(
            cfg.attn_preconditioner, cfg.d_model, cfg.attn_precond_rank,
            groups=1 if self.shared_precond else cfg.n_head, psd=cfg.preconditioner_psd,
            init=cfg.precond_init))

    # -- pieces ------------------------------------------------------------------------------
    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.n_head, -1).transpose(1, 2)  # (B, K, T, .)

    def _w(self, proj: nn.Linear) -> torch.Tensor:
        return proj.weight.view(self.n_head, self.d_head, -1)  # (K, Dh, D)

    def _diag(self) -> torch.Tensor | None:
        """D_k as (K, D) (a shared diagonal broadcast over heads), or None."""
        if self.kq_diag is None:
            return None
        return self.kq_diag.expand(self.n_head, -1) if self.kq_diag.dim() == 1 else self.kq_diag

    def score_bias(self, seq_len: int, dtype: torch.dtype) -> torch.Tensor:
        """The causal ALiBi + self/cross bias b_ijk, shape (K, T, T)."""
        return alibi_bias(self.alibi_slopes, seq_len, self.self_bias, self.cross_bias).to(dtype)

    def fixed_side(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``h~ = norm(h)`` (or ``h``, ``fixed_input``) (B, T, D) and the keys ``k``
        (B, K, T, Dh), computed once."""
        h_norm = _fixed_input(self, h)
        return h_norm, self._heads(self.k_proj(h_norm))

    def uses_flex(self, h: torch.Tensor) -> bool:
        """Whether the plain steps on ``h`` take the FlexAttention kernel (``kernel``): ``auto``
        takes it to train on a GPU; without gradients (evaluation, generation, whose lengths
        vary and would each compile a kernel) SDPA's fused GPU kernels need no bias gradient.
        ``auto`` also leaves to SDPA the layers whose q, k or v would carry the diagonal as
        d_model extra columns (a per-head diagonal, or ``energy_exact``'s value path): their
        rows overflow the kernel's shared memory on a GPU at paper sizes (``models.flex``)."""
        if self.cfg.update == "newton":
            return False
        wide = self.kq_diag is not None and (self.kq_diag.dim() == 2 or self.cfg.energy_exact)
        return self.kernel == "flex" or (self.kernel == "auto" and h.is_cuda and not wide
                                         and torch.is_grad_enabled())

    def uses_triton(self) -> bool:
        """Whether the plain steps take the Triton kernel (``kernel: triton``; the Newton step
        takes the explicit path)."""
        return self.kernel == "triton" and self.cfg.update != "newton"

    def attention_probs(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """p_ijk at iterate ``x`` given the block input ``h`` (both (B, T, D)): the softmax over
        j <= i of s_ijk, shape (B, K, T, T) (zero above the diagonal)."""
        h_norm, k = self.fixed_side(h)
        bias = self.score_bias(h.shape[1], h.dtype)
        return self._attend(self.norm(x), h_norm, k, bias, need_probs=True)[1]

    def _attend(self, u: torch.Tensor, h_norm: torch.Tensor, k: torch.Tensor,
                bias: torch.Tensor | None, need_probs: bool,
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention outputs o = sum_j p_ij v_j (B, K, T, Dh [+ D]) and optionally p; ``bias``
        None: the FlexAttention or the Triton kernel (``uses_triton``), which compute the bias
        themselves (no p)."""
        q = self._heads(self.q_proj(u))
        scale = 1 / math.sqrt(self.d_head)
        if bias is None and self.uses_triton():
            return self._attend_triton(u, h_norm, q, k, scale), None
        v, shared_scores = k, None
        if self.kq_diag is not None:
            b, t, d = u.shape
            hn = h_norm[:, None].expand(b, self.n_head, t, d)  # (B, K, T, D)
            if self.kq_diag.dim() == 1:  # shared: h~_jᵀ D u_i is one (B, T, T) term
                shared_scores = (u * self.kq_diag) @ h_norm.transpose(-1, -2) * scale
                if bias is not None:
                    bias = bias + shared_scores[:, None]
            else:  # per head: [q, D_k u] . [k, h~]
                q = torch.cat([q, u[:, None] * self._diag()[None, :, None, :]], dim=-1)
                k = torch.cat([k, hn], dim=-1)
            if self.cfg.energy_exact:
                v = torch.cat([v, hn], dim=-1)
        if bias is None:
            return alibi_flex_attention(q, k, v, self.alibi_slopes, self.self_bias,
                                        self.cross_bias, scale, shared_scores), None
        if self.kernel != "explicit" and not need_probs:
            if self.kernel == "math" or (bias.requires_grad and not q.is_cuda):
                # SDPA would run its math kernel (under vmap, requires_grad reads False)
                return sdpa_math(q, k, v, bias, scale), None
            return F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask(bias),
                                                  scale=scale), None
        p = torch.softmax(q @ k.transpose(-1, -2) * scale + bias, dim=-1)
        return p @ v, p

    def _attend_triton(self, u: torch.Tensor, h_norm: torch.Tensor, q: torch.Tensor,
                       k: torch.Tensor, scale: float) -> torch.Tensor:
        """``_attend``'s o (B, K, T, Dh [+ D]) from the Triton kernel: the shared diagonal's
        scores h~_jᵀ D u_i as its factors (D u, h~), the per-head diagonal and the exact value
        path as extra columns of q, k and v."""
        from workloads.models.kernels.cem_attention import cem_attention  # imports triton

        v, cq, ck = k, None, None
        if self.kq_diag is not None:
            b, t, d = u.shape
            hn = h_norm[:, None].expand(b, self.n_head, t, d)  # (B, K, T, D)
            if self.kq_diag.dim() == 1:
                cq, ck = u * self.kq_diag, h_norm
            else:
                q = torch.cat([q, u[:, None] * self._diag()[None, :, None, :]], dim=-1)
                k = torch.cat([k, hn], dim=-1)
            if self.cfg.energy_exact:
                v = torch.cat([v, hn], dim=-1)
        return cem_attention(q, k, v, self.alibi_slopes, self.self_bias, self.cross_bias, scale,
                             cq, ck)

    def _to_model_space(self, o: torch.Tensor) -> torch.Tensor:
        """Per-head directions g_k = W^Q_kᵀ o_k (+ D_k o~_k), shape (B, T, K, D)."""
        g = torch.einsum("bktc,kcd->btkd", o[..., :self.d_head], self._w(self.q_proj))
        if o.shape[-1] > self.d_head:  # exact value path: D_k sum_j p_ijk h~_j
            g = g + o[..., self.d_head:].transpose(1, 2) * self._diag()
        return g

    def newton_correction(self, g: torch.Tensor, p: torch.Tensor, h_norm: torch.Tensor,
                          k: torch.Tensor) -> torch.Tensor:
        """Per-head pieces of -H g, shape (B, T, K, D), for the total direction ``g`` (B, T, D).

        Derivation. With beta_kj = W^Q_kᵀ k_j + D_k h~_j and s_ijk = beta_kjᵀ u_i / tau + b_ijk,
        eps = -tau sum_k log sum_j exp(s_ijk) has gradient -sum_k sum_j p_ijk beta_kj and
        Hessian H = -(1/tau) sum_k Cov_k, Cov_k = sum_j p_ijk (beta_kj - bbar_k)(beta_kj -
        bbar_k)ᵀ, bbar_k = sum_j p_ijk beta_kj: eps is concave in u, so H has no useful inverse
        on its own. The Newton-type (implicit, proximal) step solves
        (I + eta H) delta = eta g, i.e. delta is the gradient step taken at the end point to
        first order; expanding (I + eta H)^-1 = I - eta H + (eta H)^2 - ... and keeping the first
        Neumann term gives delta = eta (g - eta H g) = eta (g + (eta/tau) sum_k Cov_k g).
        Cov_k g is computed without forming beta: with c_ijk = beta_kjᵀ g_i and r = p * c,
        sum_j r_ijk beta_kj - (sum_j r_ijk) bbar_k, whose W^Qᵀ and D_k parts are two more
        attention-shaped products. Returns (eta / tau) Cov_k g per head, i.e. the pieces of
        -eta H g.
        """
        wq, diag = self._w(self.q_proj), self._diag()
        r_q = torch.einsum("kcd,btd->bktc", wq, g)  # W^Q_k g_i  (B, K, T, Dh)
        c = r_q @ k.transpose(-1, -2)  # (B, K, T, T)
        hn = h_norm[:, None]  # (B, 1, T, D)
        if diag is not None:
            c = c + (g[:, None] * diag[None, :, None, :]) @ hn.transpose(-1, -2)
        r = p * c
        m = r.sum(-1, keepdim=True)
        cov_k = (r @ k) - m * (p @ k)  # (B, K, T, Dh)
        out = torch.einsum("bktc,kcd->btkd", cov_k, wq)
        if diag is not None:
            cov_h = (r @ hn) - m * (p @ hn)  # (B, K, T, D)
            out = out + cov_h.transpose(1, 2) * diag
        return self.step_size / math.sqrt(self.d_head) * out

    def output_weight(self) -> torch.Tensor:
        """(K*Dh, D): rows W^Q_k P_k, so that sum_k P_k W^Q_kᵀ o_k = o_flat @ output_weight()
        (the shared P: rows W^Q P, for P sum_k W^Q_kᵀ o_k).

        P is symmetric, so the preconditioner folds into the weights (a weight-only product
        per step) instead of acting on every token.
        """
        if self.precond is None:
            return self.q_proj.weight
        if self.shared_precond:
            return self.precond(self.q_proj.weight[:, None, :])[:, 0]
        w = self._w(self.q_proj).transpose(0, 1)  # (Dh, K, D): row vectors per head
        return self.precond(w).transpose(0, 1).reshape(-1, w.shape[-1])

    def direction(self, x: torch.Tensor, h_norm: torch.Tensor, k: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
        """The update direction at iterate ``x`` (B, T, D): sum_k P_k (g_k [+ Newton term]);
        ``bias`` (K, T, T), or None for the FlexAttention kernel (``uses_flex``)."""
        u = self.norm(x)
        newton = self.cfg.update == "newton"
        o, p = self._attend(u, h_norm, k, bias, need_probs=newton)
        if not newton and o.shape[-1] == self.d_head:  # values in head space: one matmul
            b, _, t, _ = o.shape
            return o.transpose(1, 2).reshape(b, t, -1) @ self.output_weight()
        g_heads = self._to_model_space(o)  # (B, T, K, D)
        if newton:
            g_heads = g_heads + self.newton_correction(g_heads.sum(2), p, h_norm, k)
        if self.precond is None:
            return g_heads.sum(2)
        if self.shared_precond:  # one P after the head sum
            return self.precond(g_heads.sum(2, keepdim=True))[:, :, 0]
        return self.precond(g_heads).sum(2)

    # -- the update --------------------------------------------------------------------------
    def iterates(self, h: torch.Tensor, carry: dict | None = None) -> list[torch.Tensor]:
        """x^(0) = h (or norm(h), ``recursion_start``), x^(1), ..., x^(T), each (B, T, D).

        ``carry``: with ``momentum_scope: layer``, a dict shared by the layers of one forward
        pass; the velocity is read from and written back to it.
        """
        cfg, eta = self.cfg, self.step_size
        fused = self.uses_flex(h) or self.uses_triton()  # kernels that compute the bias
        bias = None if fused else self.score_bias(h.shape[1], h.dtype)
        xs = [h if cfg.recursion_start == "h" else self.norm(h)]
        if cfg.layer_reuse:  # plain reuse: the whole residual sublayer again, keys recomputed
            for _ in range(cfg.attn_steps):
                h_norm, k = self.fixed_side(xs[-1])
                xs.append(xs[-1] + eta * self.direction(xs[-1], h_norm, k, bias))
            return xs
        h_norm, k = self.fixed_side(h)
        uses_velocity = cfg.update in ("momentum", "nesterov")
        carried = uses_velocity and cfg.momentum_scope == "layer" and carry is not None
        velocity = carry.get(VELOCITY) if carried else None
        x = xs[0]
        for _ in range(cfg.attn_steps):
            if not uses_velocity:
                x = x + eta * self.direction(x, h_norm, k, bias)
            else:
                mu_v = 0 if velocity is None else cfg.momentum * velocity
                at = x + eta * mu_v if cfg.update == "nesterov" else x
                velocity = mu_v + self.direction(at, h_norm, k, bias)
                x = x + eta * velocity
            xs.append(x)
        if carried:
            carry[VELOCITY] = velocity
        return xs

    def forward(self, h: torch.Tensor, carry: dict | None = None) -> torch.Tensor:
        return self.iterates(h, carry)[-1]

    def energy(self, x: torch.Tensor, h: torch.Tensor, per_head: bool = False) -> torch.Tensor:
        """eps(norm(x) | h~) of every token (B, T) (per head: (B, T, K)), Eq. 1 + App. A;
        h~ = norm(h) (or h, ``fixed_input``)."""
        return interaction_energy(self.norm(x), _fixed_input(self, h), self._w(self.q_proj),
                                  self._w(self.k_proj), self._diag(),
                                  self.score_bias(h.shape[1], h.dtype), per_head=per_head)


class CEMMLP(nn.Module):
    """Weight-tied gated MLP: descent on the element-wise energy (Eq. 7-11, Sec. 2.3).

    ``gamma = W h~`` is fixed across steps; for each step ``u = norm(x)`` and

        x <- x + eta P Vᵀ (gamma ∘ SiLU(V u))

    where Vᵀ(gamma ∘ SiLU(V u)) = -grad_u xi(u | h~), xi = -gammaᵀ phi(V u), phi = int SiLU.
    With ``layer_reuse``: plain reuse, gamma recomputed from each new state.
    Parameters ``gate_proj`` (W: D -> d_mlp), ``up_proj`` (V: D -> d_mlp; Vᵀ is the down map,
    Eq. 11), ``step_size`` (1,) when learnable, ``precond`` (one ``Preconditioner``).
    Input and output (B, T, D).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.gate_proj = nn.Linear(cfg.d_model, cfg.d_mlp, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.d_mlp, bias=False)
        self.step_size = _step_size(cfg.mlp_step_size, cfg.learn_step_size)
        self.precond = (None if cfg.mlp_preconditioner == "identity" else Preconditioner(
            cfg.mlp_preconditioner, cfg.d_model, cfg.mlp_precond_rank,
            psd=cfg.preconditioner_psd, init=cfg.precond_init))

    def down_weight(self) -> torch.Tensor:
        """(d_mlp, D): V P, so that P Vᵀ a = a @ down_weight() (P symmetric: folded into the
        weights per step instead of acting on every token)."""
        v = self.up_proj.weight
        return v if self.precond is None else self.precond(v[:, None, :])[:, 0, :]

    def direction(self, x: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
        """P Vᵀ (gamma ∘ SiLU(V norm(x))), shape (B, T, D)."""
        return (gamma * F.silu(self.up_proj(self.norm(x)))) @ self.down_weight()

    def iterates(self, h: torch.Tensor) -> list[torch.Tensor]:
        """x^(0) = h (or norm(h), ``recursion_start``), ..., x^(T), each (B, T, D)."""
        xs = [h if self.cfg.recursion_start == "h" else self.norm(h)]
        gamma = self.gate_proj(_fixed_input(self, h))  # fixed: gamma = W h~, (B, T, d_mlp)
        for _ in range(self.cfg.mlp_steps):
            if self.cfg.layer_reuse and len(xs) > 1:  # plain reuse: from each new state
                gamma = self.gate_proj(_fixed_input(self, xs[-1]))
            xs.append(xs[-1] + self.step_size * self.direction(xs[-1], gamma))
        return xs

    def forward(self, h: torch.Tensor, carry: dict | None = None) -> torch.Tensor:
        return self.iterates(h)[-1]

    def energy(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """xi(norm(x) | h~) of every token, (B, T) (Eq. 7); h~ = norm(h) (or h,
        ``fixed_input``)."""
        return elementwise_energy(self.norm(x), self.gate_proj(_fixed_input(self, h)),
                                  self.up_proj.weight)
