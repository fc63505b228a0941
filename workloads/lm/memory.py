"""How much memory one worker of a trial needs: model states under ZeRO, plus activations.

Model states follow the ZeRO paper (Rajbhandari et al., 2020, Sec. 3 and 5) for Adam with Ψ
parameters on N_d data-parallel workers: in bf16, 2Ψ bytes of weights, 2Ψ of gradients and
K = 12 Ψ of optimizer states (fp32 master weights, first and second moments); in fp32, 4Ψ, 4Ψ
and 8Ψ (the two moments). ZeRO stage 1 shards the optimizer states over N_d, stage 2 the
gradients too, stage 3 the weights too.

Activations are what one micro-batch of b sequences of s tokens keeps for the backward pass, in
the compute dtype (e bytes), counted per sublayer evaluation (a recursive sublayer, T steps,
keeps T of them):
    attention: b s 6 D e + S  (norm, q, k, v, output; S: the kernel's, ``kernel_bytes``)
    MLP:       b s (3 D + 4 d_mlp) e  (norm, output; gate, up, activation, product)
    per model: b s D e (embedding) + b s V (2 e + 8)  (logits, their fp32 copy for the loss, its
               gradient, and the logits' own gradient, which the fp32 one lives beside).
S follows the kernel that runs: on the unfused path (a CPU's) 3 b K s^2 e (scores, bias and
probabilities per head); with a GPU's fused kernels (``fused_attention``) nothing for Llama's
causal attention and K s^2 e for its ALiBi mask (one (1, K, s, s) tensor per layer); for CEM's
FlexAttention kernel, which computes ALiBi and the self/cross bias in the kernel, no scores per
head, but b s^2 e for a shared diagonal's (b, s, s) scores, which it reads in the compute dtype,
and, in bf16, 8 b s K d_head for the fp32 copies of q and k that the merge with each query's own
key keeps (``models.flex``);
b K s^2 e for CEM's bias on SDPA (a per-head diagonal, or a diagonal with ``energy_exact``),
3 b K s^2 e on the explicit path of a Newton step.
No activation checkpointing is counted (the engine uses none).

The estimate plus 4 bytes per parameter (bf16 weights and gradients, no optimizer states) is what
``workloads.lm.step_bench`` measures of an eager step; its ratio to the measured peaks is in
docs/benchmarks.md. A compiled model peaks lower: there the estimate is an upper bound.
"""

from __future__ import annotations

from dataclasses import dataclass

from workloads.core.config import EngineConfig, ResourcesConfig
from workloads.core.precision import planned_precision
from workloads.models import ModelConfig
from workloads.models.decoder import parameter_counts


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one worker holds at the peak of a step."""

    parameters: float
    gradients: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer + self.activations

    def describe(self) -> str:
        """``12.3 GiB (weights 1.0, gradients 1.0, optimizer 6.0, activations 4.3 GiB)``."""
        gib = 2**30
        return (f"{self.total / gib:.1f} GiB (weights {self.parameters / gib:.1f}, gradients "
                f"{self.gradients / gib:.1f}, optimizer {self.optimizer / gib:.1f}, activations "
                f"{self.activations / gib:.1f} GiB)")


def activation_bytes(model: ModelConfig, micro_batch_size: int, precision: str,
                     fused_attention: bool = True) -> float:
    """Bytes of activations kept for the backward pass of one micro-batch (module docstring).

    Raises:
        KeyError: ``precision`` is neither ``bf16`` nor ``fp32``.
    """
    e = {"bf16": 2, "fp32": 4}[precision]
    tokens = micro_batch_size * model.context_length
    attention = tokens * 6 * model.d_model * e + kernel_bytes(model, micro_batch_size, e,
                                                              fused_attention)
    mlp = tokens * (3 * model.d_model + 4 * model.d_mlp) * e
    per_layer = model.attn_steps * attention + model.mlp_steps * mlp
    return model.n_layer * per_layer + tokens * (model.d_model * e
                                                 + model.vocab_size * (2 * e + 8))


def kernel_bytes(model: ModelConfig, micro_batch_size: int, e: int, fused_attention: bool,
                 ) -> float:
    """Bytes one attention evaluation's kernel keeps for the backward pass, at ``e`` bytes per
    element, beyond its projections: the scores as the kernel keeps them (module docstring; on
    a GPU CEM takes FlexAttention where ``models.cem.CEMAttention.uses_flex`` does)."""
    b, s, k = micro_batch_size, model.context_length, model.n_head
    per_head = b * k * s * s * e
    if not fused_attention:
        return 3 * per_head
    if model.attention == "llama":
        return k * s * s * e if model.position == "alibi" else 0
    if model.update == "newton":
        return 3 * per_head
    if model.kq_diag == "per_head" or (model.energy_exact and model.kq_diag != "none"):
        return per_head  # the diagonal as d_model more columns of q, k or v: SDPA
    merge = 8 * b * s * k * model.d_head if e < 4 else 0  # fp32 copies of q and k
    return merge + (b * s * s * e if model.kq_diag == "shared" else 0)


def estimate_memory(model: ModelConfig, micro_batch_size: int, zero_stage: int,
                    world_size: int, precision: str, fused_attention: bool = True,
                    ) -> MemoryEstimate:
    """Memory per worker of training ``model`` with Adam under ZeRO ``zero_stage`` (0-3) on
    ``world_size`` data-parallel workers, in ``precision`` (``bf16``: mixed precision with fp32
    master weights; ``fp32``), at ``micro_batch_size`` sequences per pass, with or without a
    fused attention kernel (``activation_bytes``).

    Raises:
        KeyError: ``precision`` is neither ``bf16`` nor ``fp32``.
    """
    psi = parameter_counts(model)["total"]
    weights, grads, states = {"bf16": (2, 2, 12), "fp32": (4, 4, 8)}[precision]

    def shard(nbytes: float, from_stage: int) -> float:
        return nbytes / world_size if zero_stage >= from_stage else nbytes

    return MemoryEstimate(parameters=shard(weights * psi, 3), gradients=shard(grads * psi, 2),
                          optimizer=shard(states * psi, 1),
                          activations=activation_bytes(model, micro_batch_size, precision,
                                                       fused_attention))


def trial_memory(model: ModelConfig, engine: EngineConfig, resources: ResourcesConfig,
                 micro_batch_size: int) -> MemoryEstimate:
    """``estimate_memory`` of a trial: its ZeRO stage, worker count and precision
    (``workloads.core.precision.planned_precision``), with fused attention on GPUs only."""
    return estimate_memory(model, micro_batch_size, engine.zero_stage, resources.num_workers,
                           planned_precision(engine.precision, resources.use_gpu),
                           fused_attention=resources.use_gpu)
