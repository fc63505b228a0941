"""Trials per hour of stacked trials (``workloads.runtime.stacked``) against trials trained
alone, per size and stack size K: ``python -m workloads.lm.step_bench --stack 1,2,4,8``.

A train step here is what a trial's step costs: forward, backward, gradient clipping and the
AdamW update of a global batch of ``batch`` sequences, fp32 or bf16 as ``--precision``. K = 1
is a trial alone (``Trainer``: the model, torch's AdamW, SDPA's fused kernels); K > 1 one
``Stack`` of K members. Trials per hour: 3600 s over the steps of a trial at ``budget_scale`` of
the size's Chinchilla budget times the step's seconds per member (training alone, without
evaluation or startup).
"""

from __future__ import annotations

from statistics import median_high

import torch

from workloads.core.architecture import ModelConfig
from workloads.core.config import BudgetConfig, OptimizerConfig
from workloads.lm.workload import mean_loss, steps_for, token_budget
from workloads.models import build_model, next_token_loss
from workloads.models.decoder import with_math_attention
from workloads.runtime.optim import build_optimizer
from workloads.runtime.stacked import Stack
from workloads.runtime.timing import timed_calls


def train_step(cfg: ModelConfig, k: int, batch: int, bf16: bool):
    """One train step of ``k`` trials of ``cfg`` (alone for ``k`` = 1) on random tokens, as
    a closure."""
    idx = torch.randint(0, cfg.vocab_size, (k, batch, cfg.context_length + 1))
    models = []
    for seed in range(k):
        torch.manual_seed(seed)
        models.append(build_model(cfg))
    cpu = torch.device("cpu")
    if k == 1:
        model, opt = models[0], build_optimizer(models[0], OptimizerConfig(), lr=1e-3)

        def alone() -> None:
            with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
                loss = next_token_loss(model(idx[0, :, :-1]), idx[0, :, 1:])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return alone
    stack = Stack(models, [1e-3] * k, OptimizerConfig(), mean_loss, with_math_attention, cpu, bf16)
    alive = torch.ones(k, dtype=torch.bool)
    pairs = [(idx[m, :, :-1], idx[m, :, 1:]) for m in range(k)]
    return lambda: stack.step([pairs], 1.0, alive)


def step_seconds(step, seconds: float) -> float:
    """The median seconds of ``step`` over about ``seconds`` (at least 3 calls) after 2
    warm-up calls."""
    step()
    step()
    return median_high(timed_calls(step, seconds))


def stack_rows(presets: list[str], configs: dict[str, dict[str, ModelConfig]], stacks: list[int],
               batch: int, seconds: float, bf16: bool, budget_scale: float) -> list[dict]:
    """One row per (preset, variant, K): ``step_ms`` of the stack, ``ms_per_trial_step``
    (over K), ``trials_per_hour`` and ``vs_alone`` (its trials per hour over K = 1's, which
    ``stacks`` must hold). ``configs``: ``{preset: {variant: config}}``."""
    rows = []
    for preset in presets:
        for variant, cfg in configs[preset].items():
            tokens = token_budget(BudgetConfig(budget_scale=budget_scale), preset,
                                  cfg.vocab_size)
            steps = steps_for(tokens, batch, cfg.context_length)
            alone = None
            for k in stacks:
                seconds_k = step_seconds(train_step(cfg, k, batch, bf16), seconds)
                per_hour = 3600 / (steps * seconds_k / k)
                alone = per_hour if k == 1 else alone
                rows.append({"preset": preset, "variant": variant, "K": k,
                             "steps_per_trial": steps, "step_ms": 1000 * seconds_k,
                             "ms_per_trial_step": 1000 * seconds_k / k,
                             "trials_per_hour": per_hour, "vs_alone": per_hour / alone})
                print(f"[bench] {preset} {variant} K={k}: {1000 * seconds_k:.1f} ms a step, "
                      f"{per_hour:,.0f} trials/h", flush=True)
    return rows
