"""How much of an attention pattern is content and how much is position.

Attention with an additive position bias (CEM attention, App. A; Llama with ``position: alibi``)
has probabilities ``p_ijk = softmax_j(c_ijk + b_ijk)``: a content score ``c`` (the query-key
product, plus the KQ diagonal term in CEM) and the bias ``b`` (ALiBi slopes, self/cross bias).
Its position prior is ``p0_ijk = softmax_j(b_ijk)``, what the layer attends to when the scores
ignore the tokens. ``KL(p || p0)`` (nats, mean over tokens and heads) is 0 for attention that
reads position only. When it is near 0 in CEM attention, every recursion step attends as the
first did and its direction ``W^Qᵀ sum_j p_ij k_j`` does not depend on the iterate: T steps of
size eta are one step of T eta (docs/recursion.md).

Reads a trained model; changes nothing a trial computes (not part of ``code_fingerprint``).
"""

from __future__ import annotations

import torch

from workloads.models.cem import CEMAttention
from workloads.models.decoder import DecoderLM
from workloads.models.llama import LlamaAttention
from workloads.models.position import alibi_bias


def _entropy(p: torch.Tensor) -> torch.Tensor:
    return -torch.special.xlogy(p, p).sum(-1)


def _llama_probs(attn: LlamaAttention, h: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """p of a Llama ALiBi attention at its input ``h`` (B, T, D): (B, K, T, T)."""
    x = attn.norm(h)
    q, k = attn._heads(attn.q_proj(x)), attn._heads(attn.k_proj(x))
    return torch.softmax(q @ k.transpose(-1, -2) / attn.d_head ** 0.5 + bias, dim=-1)


def _row(layer: int, step: int, p: torch.Tensor, p0: torch.Tensor) -> dict:
    """Summary of ``p`` (B, K, T, T) against its prior ``p0`` (K, T, T)."""
    p, p0 = p.double(), p0.double().expand_as(p)
    kl = (torch.special.xlogy(p, p) - torch.special.xlogy(p, p0)).sum(-1)  # (B, K, T)
    return {"layer": layer, "step": step, "entropy": _entropy(p).mean().item(),
            "prior_entropy": _entropy(p0).mean().item(), "kl_to_prior": kl.mean().item()}


@torch.no_grad()
def position_prior_kl(model: DecoderLM, idx: torch.Tensor) -> list[dict]:
    """Per layer (and recursion step), the attention's entropy, its position prior's entropy
    and ``KL(p || p0)``, all in nats, mean over the tokens of ``idx`` (B, T) and the heads.

    CEM attention: one row per step t = 1..T (queries at the iterate x^(t-1), keys from the
    layer input). Llama attention with ALiBi: one row per application. Llama with RoPE has no
    additive prior and gives no row.
    """
    rows: list[dict] = []
    h = model.embed_tokens(idx)  # (B, T, D)
    carry = {} if model.cfg.momentum_scope == "layer" else None
    seq_len = idx.shape[1]
    for layer, block in enumerate(model.blocks):
        attn = block.attn
        if isinstance(attn, CEMAttention):
            p0 = torch.softmax(attn.score_bias(seq_len, torch.float32), dim=-1)  # (K, T, T)
            xs = attn.iterates(h, carry)
            rows += [_row(layer, t, attn.attention_probs(
                x, x if attn.cfg.layer_reuse else h).float(), p0)  # reuse: keys from x
                for t, x in enumerate(xs[:-1], start=1)]
            out = xs[-1]
        else:
            out = attn(h, carry)
            if isinstance(attn, LlamaAttention) and attn.position == "alibi":
                bias = alibi_bias(attn.alibi_slopes, seq_len, attn.self_bias,
                                  attn.cross_bias).float()
                x = h
                for t in range(1, attn.steps + 1):
                    rows.append(_row(layer, t, _llama_probs(attn, x, bias),
                                     torch.softmax(bias, dim=-1)))
                    x = attn._layer(x)
        h = block.mlp(out, carry)
    return rows
