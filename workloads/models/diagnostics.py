"""Energy diagnostics: does each CEM step descend its energy, and is each P positive definite?"""

from __future__ import annotations

import torch

from workloads.models.cem import CEMMLP, CEMAttention
from workloads.models.model import DecoderLM


@torch.no_grad()
def energy_diagnostics(model: DecoderLM, idx: torch.Tensor) -> dict[str, float]:
    """Per-layer, per-step mean energies and preconditioner eigenvalues on a batch ``idx`` (B, T).

    Keys: ``energy/{attn,mlp}/layer{l}/step{t}`` (t = 0..T, the mean over tokens of the
    sublayer's energy at iterate x^(t) given its input, Eq. 1 / Eq. 7) and
    ``precond_min_eig/{attn,mlp}/layer{l}[/head{k}]`` (smallest eigenvalue of each
    preconditioner: P > 0 iff positive). Llama sublayers have neither and are just applied.
    """
    out: dict[str, float] = {}
    h = model.embed_tokens(idx)
    carry = {} if model.cfg.momentum_scope == "layer" else None
    for layer, block in enumerate(model.blocks):
        for name, sub in (("attn", block.attn), ("mlp", block.mlp)):
            if not isinstance(sub, (CEMAttention, CEMMLP)):
                h = sub(h, carry)
                continue
            xs = sub.iterates(h, carry) if isinstance(sub, CEMAttention) else sub.iterates(h)
            for t, x in enumerate(xs):
                out[f"energy/{name}/layer{layer}/step{t}"] = sub.energy(x, h).float().mean().item()
            if sub.precond is not None:
                eigs = sub.precond.min_eigenvalue().tolist()
                if len(eigs) == 1:
                    out[f"precond_min_eig/{name}/layer{layer}"] = eigs[0]
                else:
                    out.update({f"precond_min_eig/{name}/layer{layer}/head{k}": e
                                for k, e in enumerate(eigs)})
            h = xs[-1]
    return out
