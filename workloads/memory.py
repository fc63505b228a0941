"""How much memory one worker of a trial needs: model states under ZeRO, plus activations.

Model states follow the ZeRO paper (Rajbhandari et al., 2020, Sec. 3 and 5) for Adam with Ψ
parameters on N_d data-parallel workers: in bf16, 2Ψ bytes of weights, 2Ψ of gradients and
K = 12 Ψ of optimizer states (fp32 master weights, first and second moments); in fp32, 4Ψ, 4Ψ
and 8Ψ (the two moments). ZeRO stage 1 shards the optimizer states over N_d, stage 2 the
gradients too, stage 3 the weights too.

Activations are what one micro-batch of b sequences of s tokens keeps for the backward pass, in
the compute dtype (e bytes), counted per sublayer evaluation (a recursive sublayer, T steps,
keeps T of them):
    attention: b s (6 D + c K s) e  (norm, q, k, v, output; and per head a row of s scores:
               c = 3 on the unfused path, which keeps scores, bias and probabilities; with a
               fused kernel (``fused_attention``, a GPU's) c = 0 for Llama's causal attention
               and c = 1 for CEM's, whose ALiBi and shared-diagonal bias is one (b, K, s, s)
               tensor)
    MLP:       b s (3 D + 4 d_mlp) e  (norm, output; gate, up, activation, product)
    per model: b s D e (embedding) + b s V (e + 8)  (logits, their fp32 copy for the loss and
               its gradient).
No activation checkpointing is counted (the engine uses none).
"""

from __future__ import annotations

from dataclasses import dataclass

from workloads.config import ResourcesConfig, TrainingConfig
from workloads.models import ModelConfig
from workloads.models.model import parameter_counts
from workloads.optim import planned_precision


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
    rows = 3 if not fused_attention else (1 if model.attention == "cem" else 0)
    attention = (6 * model.d_model + rows * model.n_head * model.context_length) * e
    mlp = (3 * model.d_model + 4 * model.d_mlp) * e
    per_layer = model.attn_steps * attention + model.mlp_steps * mlp
    return tokens * (model.n_layer * per_layer + model.d_model * e
                     + model.vocab_size * (e + 8))


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


def trial_memory(model: ModelConfig, training: TrainingConfig, resources: ResourcesConfig,
                 micro_batch_size: int) -> MemoryEstimate:
    """``estimate_memory`` of a trial: its ZeRO stage, worker count and precision
    (``workloads.optim.planned_precision``), with fused attention on GPUs only."""
    return estimate_memory(model, micro_batch_size, training.zero_stage, resources.num_workers,
                           planned_precision(training.precision, resources.use_gpu),
                           fused_attention=resources.use_gpu)
