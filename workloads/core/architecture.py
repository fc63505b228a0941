"""One ``ModelConfig`` for every architecture variant, and the named presets."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Literal

AttentionKind = Literal["llama", "cem"]
MlpKind = Literal["llama", "cem"]
Position = Literal["rope", "alibi"]
KQDiag = Literal["none", "shared", "per_head"]
PreconditionerKind = Literal["identity", "diag", "diag_lowrank"]
PrecondPlacement = Literal["per_head", "shared"]
PrecondInit = Literal["softplus1", "unit"]
RecursionStart = Literal["h", "norm_h"]
FixedInput = Literal["norm_h", "h"]
UpdateRule = Literal["gd", "momentum", "nesterov", "newton"]
MomentumScope = Literal["step", "layer"]

_CHOICES = {"attention": AttentionKind, "mlp": MlpKind, "position": Position, "kq_diag": KQDiag,
            "attn_preconditioner": PreconditionerKind, "mlp_preconditioner": PreconditionerKind,
            "attn_precond_placement": PrecondPlacement, "precond_init": PrecondInit,
            "recursion_start": RecursionStart, "fixed_input": FixedInput, "update": UpdateRule,
            "momentum_scope": MomentumScope}


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only language model.

    Variants are fields, never subclasses: ``attention`` and ``mlp`` pick the sublayer kind, so the
    four Llama/CEM combinations are four configs of the same ``DecoderLM``.

    Fields (field-standard names; defaults give the paper's single-step layers of Sec. 4.1 and
    its choices where it makes one; the ``cem-*`` presets carry its best setting, Sec. 4.3):
        vocab_size, d_model (D), n_layer, n_head (K; ``d_head = d_model // n_head``), d_mlp,
            context_length: the usual sizes.
        attention: ``llama`` (multi-head attention, untied q/k/v/o) or ``cem`` (weight-tied
            descent on the interaction energy, Eq. 1-5, ALiBi, App. A).
        mlp: ``llama`` (SwiGLU) or ``cem`` (descent on the element-wise energy, Eq. 7-11).
        position: position encoding of Llama attention, ``rope`` or ``alibi`` (CEM is ALiBi).
        attn_steps, mlp_steps: T, the number of updates of a sublayer. For CEM, within-layer
            recursion (Sec. 2.3): keys/values (and gamma) fixed, only the query side re-evaluated.
        recursion_start: where a CEM sublayer's iterate starts: ``h`` (x^(0) = h, Sec. 2.3's
            "starting from x_i^(0) = h_i", the residual stream) or ``norm_h`` (x^(0) =
            RMSNorm(h), Algorithm 1 read literally: "h <- RMSNorm(h); x <- h").
            For a Llama sublayer, or with ``layer_reuse``, plain reuse: the whole residual
            sublayer applied T times, keys/values recomputed from the new state (Fig. 3c, 4).
        fixed_input: what a CEM sublayer's fixed side (the attention keys = values, the MLP's
            gamma) is computed from: ``norm_h`` (RMSNorm(h), Algorithm 1's "h <- RMSNorm(h)"
            before the keys) or ``h`` (the residual stream itself, the energy read as given
            "the context h_{1:i}", Eq. 1, without a norm).
        layer_reuse: make CEM sublayers with T > 1 plain reuse instead of recursion (ablation).
        attn_step_size, mlp_step_size: eta of the CEM updates (1.0 recovers Eq. 3 and 9);
            ``learn_step_size`` makes them learnable scalars initialised there.
        kq_diag: diagonal of A_k = diag(d_k) + W^Qᵀ_k W^K_k (Sec. 2.3): ``none``, ``shared``
            across heads, or ``per_head``.
        attn_preconditioner (rank ``attn_precond_rank``), mlp_preconditioner (rank
            ``mlp_precond_rank``): ``identity``, ``diag`` = diag(softplus(d)) or ``diag_lowrank`` =
            diag(softplus(d)) + UVᵀ + VUᵀ (Sec. 2.3, App. C.4).
        attn_precond_placement: ``per_head`` (the paper's P_k, one per head, applied before the
            head sum: no descent guarantee, even with every P_k positive definite) or
            ``shared`` (one P applied after the head sum, to the whole gradient: a positive
            definite P and an exact gradient make every small enough step a descent step).
        preconditioner_psd: use diag(softplus(d)) + UUᵀ instead, positive definite by
            construction (UVᵀ + VUᵀ is indefinite once V moves).
        precond_init: ``softplus1`` (App. C.4: d = 1, so P = softplus(1) I = 1.31 I at
            initialisation, a 31% longer first step than without P) or ``unit`` (d =
            softplus^-1(1): P = I at initialisation).
        energy_exact: include the D_k h~_j term in the value path, so the step is the exact
            gradient of Eq. 1 with a diagonal (Algorithm 1 drops it).
        update: CEM attention update rule (intrinsic-optimizers paper): ``gd``, ``momentum``,
            ``nesterov`` (coefficient ``momentum``) or ``newton``: a proximal Newton step, the
            first Neumann term of (I + eta H)^-1 (requires ``energy_exact``: it differentiates
            the energy, so the step must be its exact gradient).
        momentum_scope: velocity kept within one sublayer's recursion (``step``; needs
            ``attn_steps`` > 1, else momentum is plain gd and is refused) or carried from each
            layer's attention to the next (``layer``).
        rope_theta, norm_eps, init_std: RoPE base, RMSNorm epsilon, init standard deviation.

    Raises:
        ValueError: on a non-positive size, ``d_model`` not divisible by ``n_head``, momentum
            that would keep no velocity, or ``newton`` without ``energy_exact``.
    """

    vocab_size: int = 4096
    d_model: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_mlp: int = 384
    context_length: int = 256
    attention: AttentionKind = "llama"
    mlp: MlpKind = "llama"
    position: Position = "rope"
    attn_steps: int = 1
    mlp_steps: int = 1
    layer_reuse: bool = False
    attn_step_size: float = 1.0
    mlp_step_size: float = 1.0
    learn_step_size: bool = False
    kq_diag: KQDiag = "none"
    attn_preconditioner: PreconditionerKind = "identity"
    mlp_preconditioner: PreconditionerKind = "identity"
    attn_precond_rank: int = 4
    attn_precond_placement: PrecondPlacement = "per_head"
    precond_init: PrecondInit = "softplus1"
    recursion_start: RecursionStart = "h"
    fixed_input: FixedInput = "norm_h"
    mlp_precond_rank: int = 16
    preconditioner_psd: bool = False
    energy_exact: bool = False
    update: UpdateRule = "gd"
    momentum: float = 0.9
    momentum_scope: MomentumScope = "step"
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layer", "n_head", "d_mlp", "context_length",
                     "attn_steps", "mlp_steps", "attn_precond_rank", "mlp_precond_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head "
                             f"({self.n_head})")
        for name, kind in _CHOICES.items():
            if getattr(self, name) not in typing.get_args(kind):
                raise ValueError(f"{name} must be one of {typing.get_args(kind)}, "
                                 f"got {getattr(self, name)!r}")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if (self.attention == "cem" and self.update in ("momentum", "nesterov")
                and self.momentum_scope == "step" and self.attn_steps == 1):
            raise ValueError(f"update {self.update!r} with momentum_scope 'step' and "
                             "attn_steps 1 keeps no velocity (plain gd): use momentum_scope "
                             "'layer' or attn_steps > 1")
        if self.update == "newton" and not self.energy_exact:
            raise ValueError("update 'newton' (a proximal Newton step, the first Neumann term of "
                             "(I + eta H)^-1) needs the exact energy gradient: energy_exact: true")

    @property
    def exact_gradient(self) -> bool:
        """Whether every CEM attention step is the (preconditioned) gradient of its energy,
        Eq. 1: false for CEM attention with a KQ diagonal but without ``energy_exact``
        (Algorithm 1 drops the diagonal's term from the value path). Llama sublayers and the
        CEM MLP are exact by construction or not energy descents at all."""
        return not (self.attention == "cem" and self.kq_diag != "none"
                    and not self.energy_exact)

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


# The paper's best CEM configuration (Sec. 4.3): both sublayers CEM, T = 2, shared KQ diagonal,
# diagonal-plus-low-rank preconditioners.
CEM_BEST = {"attention": "cem", "mlp": "cem", "attn_steps": 2, "mlp_steps": 2,
            "kq_diag": "shared", "attn_preconditioner": "diag_lowrank",
            "mlp_preconditioner": "diag_lowrank"}


PRESETS: dict[str, ModelConfig] = {
    # CPU sizes for tests and demos, and the claims' CPU twins (pico, nano, tiny: a tenfold
    # range of parameters, each on a quarter of its Chinchilla budget within a working day on
    # 2 cores), with a 512-token BPE.
    "pico": ModelConfig(vocab_size=512, d_model=16, n_layer=2, n_head=2, d_mlp=48,
                        context_length=64),
    "nano": ModelConfig(vocab_size=512, d_model=32, n_layer=2, n_head=2, d_mlp=96,
                        context_length=64),
    "tiny": ModelConfig(vocab_size=512, d_model=64, n_layer=3, n_head=4, d_mlp=192,
                        context_length=128),
    "micro": ModelConfig(vocab_size=4096, d_model=128, n_layer=4, n_head=4, d_mlp=384,
                         context_length=256),
    "mini": ModelConfig(vocab_size=4096, d_model=256, n_layer=6, n_head=8, d_mlp=704,
                        context_length=512),
    # Paper Table 1 (vocabulary 32000, context 2048).
    "llama-86m": _paper(672, 8, 8, 1792),
    "llama-108m": _paper(672, 12, 12, 1792),
    "llama-134m": _paper(768, 12, 12, 2048),
    "llama-162m": _paper(864, 12, 12, 2304),
    # The appendix's 256M run: the paper gives no dimensions; these give 256.4M parameters.
    "llama-256m": _paper(1024, 14, 16, 3072),
}
PRESETS.update({f"cem-{name.split('-', 1)[1]}": dataclasses.replace(cfg, **CEM_BEST)
                for name, cfg in list(PRESETS.items()) if name.startswith("llama-")})
# GP regression (App. D, Table 3): a stack of CEM MLPs on a d_model-dimensional latent state;
# only d_model, n_layer, d_mlp and the mlp_* fields matter.
PRESETS.update({
    "gp-small": ModelConfig(d_model=32, n_layer=2, n_head=1, d_mlp=128, mlp="cem"),
    "gp-base": ModelConfig(d_model=64, n_layer=4, n_head=1, d_mlp=256, mlp="cem"),
})
