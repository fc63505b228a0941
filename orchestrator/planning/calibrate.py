"""Wall-time estimates from a short measured calibration step on this machine."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from orchestrator.planning.stacks import form_stacks
from workloads.core.architecture import ModelConfig
from workloads.core.trial import Trial
from workloads.core.workload import Workload

# What a trial costs beyond its calibrated compute: its share of its worker group's start (one
# per pack of trials, about 35 s on 2 busy cores), its evaluations, checkpoints and model upload,
# and the per-step costs the calibration step leaves out (optimizer, logging, two trials sharing
# 2 cores). Fitted on `python -m orchestrator.bench grid` (12 nano trials, 2 packs of 6 on 2
# cores, warm worker groups): 13.5 slot-seconds a trial beyond its train steps.
# Added to every trial's estimate; the job's own start (about 25 s) is not counted.
TRIAL_OVERHEAD_S = 13.5


def _measure(step: Callable[[], None], flops: float, repeats: int = 2) -> float:
    step()  # warm-up: allocations, kernel selection
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    return flops * repeats / (time.perf_counter() - start)


def achieved_flops_per_s(trial: Trial, workload: Workload, stack: int = 1) -> float:
    """Forward + backward FLOP/s that one worker of ``trial`` (``cpus_per_worker`` CPU threads,
    or this machine's GPU) achieves on its model, ``stack`` of them as one stacked model: one
    warm-up and two timed steps of the workload's ``calibration_step`` on a micro-batch,
    fp32."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    previous = torch.get_num_threads()
    torch.set_num_threads(trial.resources.cpus_per_worker)
    try:
        step, flops = workload.calibration_step(
            trial.config, trial.model, trial.micro_batch_size, device, stack=stack)
        return _measure(step, flops)
    finally:
        torch.set_num_threads(previous)


def estimate_wall_s(trials: list[Trial], workload: Workload, slots: int = 1,
                    ) -> dict[str, float]:
    """Estimated wall seconds of every trial of ``workload``, in the stacks its trials train
    in (``form_stacks`` with ``slots`` trials at once): each stack's FLOPs over the calibrated
    FLOP/s of its model's stacks on one worker times the workers, plus ``TRIAL_OVERHEAD_S`` per
    trial, shared evenly by its trials (a trial alone: a stack of one). One calibration per
    model for its trials alone, and one for its stacks, at the largest of their sizes (a
    model's stacks differ in size by at most one)."""
    stacks = form_stacks(trials, lambda t: t, workload, slots)
    largest: dict[tuple[ModelConfig, bool], int] = {}
    for stack in stacks:
        key = (stack[0].model, len(stack) > 1)
        largest[key] = max(largest.get(key, 1), len(stack))
    rates: dict[tuple[ModelConfig, bool], float] = {}
    out = {}
    for stack in stacks:
        t, k = stack[0], len(stack)
        key = (t.model, k > 1)
        if key not in rates:
            rates[key] = achieved_flops_per_s(t, workload, largest[key])
        compute = sum(m.budget.flops for m in stack) / (rates[key] * t.resources.num_workers)
        for m in stack:
            out[m.trial_id] = compute / k + TRIAL_OVERHEAD_S
    return out
