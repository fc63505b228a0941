"""One ``ModelConfig`` for every architecture variant, and the named presets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

AttentionKind = Literal["llama", "cem"]
MlpKind = Literal["llama", "cem"]


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only language model.

    Variants are fields, never subclasses: ``attention`` and ``mlp`` pick the sublayer kind, so the
    four Llama/CEM combinations are four configs of the same ``DecoderLM``.

    Fields (field-standard names):
        vocab_size: tokens in the vocabulary.
        d_model: width of the residual stream D.
        n_layer: number of blocks.
        n_head: attention heads K; ``d_head = d_model // n_head``.
        d_mlp: hidden width of the MLP (Llama gate/up width; CEM ``W, V`` rows).
        context_length: maximum sequence length T.
        attention: ``llama`` (RoPE multi-head attention, untied q/k/v/o) or ``cem`` (weight-tied
            gradient step on the interaction energy, paper Eq. 1-5, ALiBi, App. A).
        mlp: ``llama`` (SwiGLU) or ``cem`` (gradient step on the element-wise energy, Eq. 7-11).
        attn_steps, mlp_steps: recursion depth T of the CEM sublayers (1 = the paper's Sec. 4.1).
        attn_step_size, mlp_step_size: step sizes eta of the CEM updates (1.0 recovers Eq. 3 / 9).
        rope_theta: RoPE base of the Llama attention.
        norm_eps: RMSNorm epsilon.
        init_std: standard deviation of the normal initialisation of linear and embedding weights.

    Raises:
        ValueError: on a non-positive size, or ``d_model`` not divisible by ``n_head``.
    """

    vocab_size: int = 4096
    d_model: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_mlp: int = 384
    context_length: int = 256
    attention: AttentionKind = "llama"
    mlp: MlpKind = "llama"
    attn_steps: int = 1
    mlp_steps: int = 1
    attn_step_size: float = 1.0
    mlp_step_size: float = 1.0
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layer", "n_head", "d_mlp", "context_length",
                     "attn_steps", "mlp_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head "
                             f"({self.n_head})")
        if self.attention not in ("llama", "cem"):
            raise ValueError(f"attention must be 'llama' or 'cem', got {self.attention!r}")
        if self.mlp not in ("llama", "cem"):
            raise ValueError(f"mlp must be 'llama' or 'cem', got {self.mlp!r}")

    @property
    def d_head(self) -> int:
        """Per-head width D_h = d_model / n_head."""
        return self.d_model // self.n_head

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """The preset ``name`` with ``overrides`` applied, e.g. ``from_preset("micro", mlp="cem")``.

        Raises:
            KeyError: unknown preset name.
            TypeError: an override that is not a ``ModelConfig`` field.
        """
        if name not in PRESETS:
            raise KeyError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}")
        unknown = set(overrides) - cls.field_names()
        if unknown:
            raise TypeError(f"unknown ModelConfig field(s): {', '.join(sorted(unknown))}")
        return dataclasses.replace(PRESETS[name], **overrides)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _paper(d_model: int, n_layer: int, n_head: int, d_mlp: int) -> ModelConfig:
    return ModelConfig(vocab_size=32000, d_model=d_model, n_layer=n_layer, n_head=n_head,
                       d_mlp=d_mlp, context_length=2048)


PRESETS: dict[str, ModelConfig] = {
    # CPU sizes for tests and demos (vocabulary of the embedded Shakespeare BPE).
    "nano": ModelConfig(vocab_size=512, d_model=32, n_layer=2, n_head=2, d_mlp=96,
                        context_length=64),
    "micro": ModelConfig(vocab_size=4096, d_model=128, n_layer=4, n_head=4, d_mlp=384,
                         context_length=256),
    "mini": ModelConfig(vocab_size=4096, d_model=256, n_layer=6, n_head=8, d_mlp=704,
                        context_length=512),
    # Paper Table 1 (vocabulary 32000, context 2048).
    "llama-86m": _paper(672, 8, 8, 1792),
    "llama-108m": _paper(672, 12, 12, 1792),
    "llama-134m": _paper(768, 12, 12, 2048),
    "llama-162m": _paper(864, 12, 12, 2304),
}
