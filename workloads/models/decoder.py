"""The decoder-only language model, its builder and parameter accounting."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from workloads.core.architecture import ModelConfig
from workloads.models.cem import CEMMLP, CEMAttention
from workloads.models.llama import LlamaAttention, LlamaMLP
from workloads.models.shapes import shapes_only

_ATTENTION = {"llama": LlamaAttention, "cem": CEMAttention}
_MLP = {"llama": LlamaMLP, "cem": CEMMLP}
# Logits a CPU computes at once when scoring targets: a 4 MiB block stays in cache between the
# head's product and the cross-entropy's passes over it (docs/benchmarks.md, "CPU evaluation").
_CPU_LOGIT_BYTES = 4 << 20


class LMHead(nn.Linear):
    """The untied LM head, d_model -> vocab_size without bias (its parameter ``weight``).

    ``head(h)``: logits (..., vocab_size) of hidden states ``h`` (..., d_model).
    ``head(h, targets)``: the next-token NLL of each position (nats, fp32; ``targets`` token
    ids of ``h``'s leading shape), ``F.cross_entropy`` over logits made a block of rows at a
    time on a CPU (4 MiB of fp32 logits, e.g. 256 rows at vocabulary 4096), all at once on an
    accelerator: the same numbers as the cross-entropy of ``head(h)``, without writing out
    and reading back every logit. Called once per forward, so ZeRO-3 gathers ``weight`` once.
    """

    def __init__(self, d_model: int, vocab_size: int) -> None:
        super().__init__(d_model, vocab_size, bias=False)

    def forward(self, h: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is None:
            return super().forward(h)
        rows, flat, ys = h.shape[:-1].numel(), h.flatten(0, -2), targets.flatten()
        block = rows if h.device.type != "cpu" else max(1, _CPU_LOGIT_BYTES
                                                        // (4 * self.out_features))
        return torch.cat([
            F.cross_entropy(F.linear(flat[i:i + block], self.weight).float(), ys[i:i + block],
                            reduction="none")
            for i in range(0, rows, block)]).view(targets.shape)


class Block(nn.Module):
    """One layer: ``h -> mlp(attn(h))``; each sublayer owns its norm and its residual.

    ``carry`` is the per-forward dict through which layer-scope momentum passes from one
    layer's attention to the next (None otherwise).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn = _ATTENTION[cfg.attention](cfg)
        self.mlp = _MLP[cfg.mlp](cfg)

    def forward(self, h: torch.Tensor, carry: dict | None = None) -> torch.Tensor:
        return self.mlp(self.attn(h, carry), carry)


class DecoderLM(nn.Module):
    """Token embedding, ``n_layer`` blocks, final RMSNorm and an untied LM head.

    ``model(idx)`` with ``idx`` LongTensor (B, T), T <= context_length, returns logits
    (B, T, vocab_size); ``model(idx, targets)`` with ``targets`` (B, T) token ids returns each
    position's next-token NLL (B, T), nats in fp32, the same numbers as the cross-entropy of the
    logits (``LMHead``): the evaluation's path, which holds a CPU cache's worth of logits at a
    time.

    Raises:
        ValueError: T > context_length.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = LMHead(cfg.d_model, cfg.vocab_size)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=self.cfg.init_std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if idx.shape[1] > self.cfg.context_length:
            raise ValueError(f"sequence length {idx.shape[1]} exceeds context_length "
                             f"{self.cfg.context_length}")
        h = self.embed_tokens(idx)  # (B, T, D)
        carry = {} if self.cfg.momentum_scope == "layer" else None
        for block in self.blocks:
            h = block(h, carry)
        return self.lm_head(self.norm(h), targets)  # logits (B, T, vocab) or NLL (B, T)


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean next-token cross-entropy (nats), computed in fp32: ``logits`` (B, T, vocab) in
    any dtype, ``targets`` (B, T) token ids -> a scalar. Compiled (``torch.compile``), it is one
    fused pass over the logits instead of an fp32 copy of them and a softmax over that copy."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def build_model(cfg: ModelConfig) -> DecoderLM:
    """A freshly initialised ``DecoderLM`` for ``cfg`` (fp32, on the CPU)."""
    return DecoderLM(cfg)


def with_math_attention(model: DecoderLM) -> DecoderLM:
    """``model`` with every attention sublayer on its ``math`` kernel (SDPA's math kernel
    written out in plain ops, which ``torch.func.vmap`` batches: stacked trials); returns it."""
    for module in model.modules():
        if isinstance(module, LlamaAttention | CEMAttention):
            module.kernel = "math"
    return model


def count_parameters(model: DecoderLM) -> dict[str, int]:
    """Trainable parameters by role.

    Returns ints under ``total``; ``embedding`` (token embedding and LM head: the vocabulary
    parameters, as in the paper's "embedding and head"); ``attention`` and ``mlp`` (all blocks'
    sublayers, their RMSNorm included); ``other`` (the final norm).
    """
    counts = {"embedding": 0, "attention": 0, "mlp": 0, "other": 0}
    for name, p in model.named_parameters():
        if name.startswith(("embed_tokens.", "lm_head.")):
            role = "embedding"
        elif ".attn." in name:
            role = "attention"
        elif ".mlp." in name:
            role = "mlp"
        else:
            role = "other"
        counts[role] += p.numel()
    return {"total": sum(counts.values()), **counts}


def parameter_counts(cfg: ModelConfig) -> dict[str, int]:
    """``count_parameters`` of the model ``cfg`` describes, plus ``non_embedding`` (total minus
    embedding and head), built once per config for its shapes alone (``shapes_only``)."""
    return dict(_parameter_counts(cfg))


@functools.cache
def _parameter_counts(cfg: ModelConfig) -> tuple[tuple[str, int], ...]:
    with shapes_only():
        counts = count_parameters(build_model(cfg))
    return (*counts.items(), ("non_embedding", counts["total"] - counts["embedding"]))
