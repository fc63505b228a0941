"""The optimizer (the ``optimizer`` section), its learning-rate schedule (``schedule``) and the
DeepSpeed config (paper Table 2)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from workloads.core.config import deep_merged

if TYPE_CHECKING:  # annotations only
    from workloads.core.config import OptimizerConfig, ScheduleConfig


def lr_factor(step: int, total_steps: int, warmup_fraction: float,
              final_lr_fraction: float) -> float:
    """Multiplier of the peak LR after ``step`` optimizer steps (0-based).

    Linear warmup over ``ceil(warmup_fraction * total_steps)`` steps, then a cosine decay from 1
    to ``final_lr_fraction`` at the last step.
    """
    warmup = math.ceil(warmup_fraction * total_steps)
    if step < warmup:
        return (step + 1) / warmup
    decay_steps = max(total_steps - 1 - warmup, 1)
    progress = min((step - warmup) / decay_steps, 1.0)
    return final_lr_fraction + (1 - final_lr_fraction) * 0.5 * (1 + math.cos(math.pi * progress))


def decayed_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters weight decay applies to, chosen by role: the weights of projection
    matrices and embeddings (``nn.Linear``, ``nn.Embedding``), nothing else.

    Never decayed: RMSNorm gains, ALiBi self/cross biases, CEM step sizes, KQ diagonals (shared
    or per head) and every preconditioner parameter: its diagonal and its low-rank factors U, V
    (decaying U, V would pull P = diag(softplus(d)) + UVᵀ + VUᵀ towards its diagonal, a prior
    the paper does not state). Rank is not the rule: a per-head diagonal (K, D) is a diagonal.
    """
    decayed = {id(m.weight): m.weight for m in model.modules()
               if isinstance(m, nn.Linear | nn.Embedding) and m.weight.requires_grad}
    return list(decayed.values())


def build_optimizer(model: nn.Module, cfg: OptimizerConfig, lr: float) -> torch.optim.AdamW:
    """AdamW over ``model``'s parameters at peak learning rate ``lr`` (the trial's, handed
    here by the ``Trainer``) with ``cfg``'s betas, eps and weight decay, the decay on
    ``decayed_parameters`` only (paper Table 2)."""
    decay = decayed_parameters(model)
    ids = {id(p) for p in decay}
    no_decay = [p for p in model.parameters() if p.requires_grad and id(p) not in ids]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: ScheduleConfig, total_steps: int,
                    ) -> torch.optim.lr_scheduler.LambdaLR:
    """``lr_factor`` of ``cfg``'s warmup and final fraction over ``total_steps`` optimizer steps."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, total_steps, cfg.warmup_fraction, cfg.final_lr_fraction))


def deepspeed_config(micro_batch_size: int, grad_accum: int, world_size: int, zero_stage: int,
                     precision: str, grad_clip: float, extra: dict[str, Any] | None = None,
                     ) -> dict[str, Any]:
    """The DeepSpeed engine config: batch geometry, ZeRO stage, bf16 or fp32, clipping, with
    ``extra`` (the spec's ``engine.deepspeed``) merged over it key by key, nested mappings
    merged in turn.

    Two defaults differ from DeepSpeed's, for speed (docs/benchmarks.md, "A trial's step beyond
    the bench"): at ZeRO 1-2, where DeepSpeed reads the key, bf16 gradients are not checked for
    overflow (bf16 has no loss scale to adjust; the check reads every gradient and waits for the
    device each step, and a NaN shows in the loss instead of a skipped step), and with one
    worker at ZeRO 1-2 the gradients are not copied into a contiguous buffer, which has nothing
    to reduce there."""
    bf16 = precision == "bf16"
    one_worker = world_size == 1 and zero_stage in (1, 2)
    config = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": micro_batch_size * grad_accum * world_size,
        "gradient_clipping": grad_clip,
        "zero_optimization": {"stage": zero_stage,
                              **({"contiguous_gradients": False} if one_worker else {})},
        "bf16": {"enabled": bf16, **({"check_grad_overflow": False} if bf16 else {})},
        "zero_allow_untested_optimizer": True,  # the client optimizer is torch's AdamW
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    return deep_merged(config, extra or {})
