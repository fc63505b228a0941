"""Energy diagnostics: does each CEM step descend its energy (to first order, and in fact), how
large is it, how spread is the attention it takes, and is each P positive definite?"""

from __future__ import annotations

import torch

from workloads.models.cem import CEMMLP, CEMAttention
from workloads.models.decoder import DecoderLM


def _directional_derivative(sub: CEMAttention | CEMMLP, x: torch.Tensor, step: torch.Tensor,
                            h: torch.Tensor) -> torch.Tensor:
    """<grad_x eps(x | h), step> per token, (B, T): each token's energy depends on its own x
    only (the keys/gate side is h's), so the gradient of the sum is per token."""
    with torch.enable_grad():
        x = x.detach().requires_grad_(True)
        (grad,) = torch.autograd.grad(sub.energy(x, h).sum(), x)
    return (grad * step).sum(-1)


def _relative(new: torch.Tensor, old: torch.Tensor) -> float:
    """Mean over tokens of ||new - old|| / ||old|| for (B, T, D) iterates (dimensionless)."""
    old = old.float()
    return ((new.float() - old).norm(dim=-1) / old.norm(dim=-1)).mean().item()


@torch.no_grad()
def energy_diagnostics(model: DecoderLM, idx: torch.Tensor) -> dict[str, float]:
    """Per-layer, per-step mean energies and preconditioner eigenvalues on a batch ``idx`` (B, T).

    Keys: ``energy/{attn,mlp}/layer{l}/step{t}`` (t = 0..T, the mean over tokens of the
    sublayer's energy at iterate x^(t) given its input, Eq. 1 / Eq. 7); for t = 1..T,
    ``descent/{attn,mlp}/layer{l}/step{t}`` (mean over tokens of <grad_x eps(x^(t-1)),
    x^(t) - x^(t-1)>: negative when the step points downhill) and
    ``energy_fell/{attn,mlp}/layer{l}/step{t}`` (the fraction of tokens whose energy at x^(t)
    is below that at x^(t-1)), ``update_norm/{attn,mlp}/layer{l}/step{t}`` (mean over tokens of
    ||x^(t) - x^(t-1)|| / ||x^(t-1)||, dimensionless) and, for CEM attention,
    ``attn_entropy/attn/layer{l}/step{t}`` (the entropy of p_ijk over j at iterate x^(t-1), in
    nats, mean over tokens and heads: log(i) for uniform attention, 0 for attention on one
    token); and ``precond_min_eig/{attn,mlp}/layer{l}[/head{k}]``
    (smallest eigenvalue of each preconditioner: P > 0 iff positive). Llama sublayers have
    no energy: only their ``update_norm/.../step1`` (the residual update's relative size).
    """
    out: dict[str, float] = {}
    h = model.embed_tokens(idx)
    carry = {} if model.cfg.momentum_scope == "layer" else None
    for layer, block in enumerate(model.blocks):
        for name, sub in (("attn", block.attn), ("mlp", block.mlp)):
            if not isinstance(sub, (CEMAttention, CEMMLP)):  # Llama: its update size only
                out_h = sub(h, carry)
                out[f"update_norm/{name}/layer{layer}/step1"] = _relative(out_h, h)
                h = out_h
                continue
            xs = sub.iterates(h, carry) if isinstance(sub, CEMAttention) else sub.iterates(h)
            energies = [sub.energy(x, h).float() for x in xs]  # (B, T) each
            for t, x in enumerate(xs):
                key = f"layer{layer}/step{t}"
                out[f"energy/{name}/{key}"] = energies[t].mean().item()
                if t:
                    out[f"descent/{name}/{key}"] = _directional_derivative(
                        sub, xs[t - 1], x - xs[t - 1], h).mean().item()
                    out[f"energy_fell/{name}/{key}"] = (
                        (energies[t] < energies[t - 1]).float().mean().item())
                    out[f"update_norm/{name}/{key}"] = _relative(x, xs[t - 1])
                    if isinstance(sub, CEMAttention):  # plain reuse: keys from x^(t-1)
                        p = sub.attention_probs(xs[t - 1], xs[t - 1] if sub.cfg.layer_reuse
                                                else h).float()
                        out[f"attn_entropy/{name}/{key}"] = (
                            -torch.special.xlogy(p, p).sum(-1).mean().item())
            if sub.precond is not None:
                eigs = sub.precond.min_eigenvalue().tolist()
                if len(eigs) == 1:
                    out[f"precond_min_eig/{name}/layer{layer}"] = eigs[0]
                else:
                    out.update({f"precond_min_eig/{name}/layer{layer}/head{k}": e
                                for k, e in enumerate(eigs)})
            h = xs[-1]
    return out
