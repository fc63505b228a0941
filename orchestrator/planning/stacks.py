"""Which pending trials train at once as one stacked model (``workloads.runtime.stacked``):
trials of one shape (``stack_key``: they differ in learning rate and seed only) whose workload
stacks them, on one CPU worker with the plain PyTorch engine, up to ``resources.stack`` of them
and as many as the worker's reserved memory holds (``stack_cap``).

Plain data, light to import: ``orchestrator.execution.packs`` forms a pack's stacks with it, and
``orchestrator.planning.plan`` shows them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TypeVar

from workloads.core.trial import Trial, stack_key
from workloads.core.workload import Workload

T = TypeVar("T")


def stack_cap(trial: Trial, workload: Workload) -> int:
    """The most trials of ``trial``'s shape one worker trains at once: 1 unless ``workload``
    is ``stackable`` and the trial has one CPU worker and is not compiled; else
    ``resources.stack``, and no more than ``resources.memory_per_worker_gb`` holds of the
    workload's ``memory`` estimate per trial."""
    r = trial.resources
    if (r.stack == 1 or not workload.stackable or r.num_workers != 1 or r.use_gpu
            or trial.engine.compile is True):
        return 1
    estimate = workload.memory(trial.model, trial.engine, r, trial.micro_batch_size,
                               trial.config)
    if estimate is None or estimate.total <= 0:
        return r.stack
    return max(1, min(r.stack, int(r.memory_per_worker_gb * 2**30 // estimate.total)))


def form_stacks(items: Sequence[T], trial_of: Callable[[T], Trial], workload: Workload,
                slots: int = 1) -> list[tuple[T, ...]]:
    """``items`` (trials, or what carries one: ``trial_of``) in stacks, in grid order: those of
    one ``stack_key`` in as few stacks as ``stack_cap`` allows, of sizes that differ by at most
    one, each stack's members consecutive in the grid; then, while there are fewer stacks than
    ``slots`` (trials that run at once), the largest stack is split in two, so that stacking
    never leaves a slot idle that training alone would fill."""
    keys: list[Trial] = []  # a trial's configs are pydantic models: equal, not hashable
    groups: list[list[T]] = []
    for item in items:
        key = stack_key(trial_of(item))
        if key not in keys:
            keys.append(key)
            groups.append([])
        groups[keys.index(key)].append(item)
    counts = [math.ceil(len(group) / stack_cap(trial_of(group[0]), workload))
              for group in groups]
    while sum(counts) < slots:
        i = max(range(len(groups)), key=lambda i: len(groups[i]) / counts[i])
        if len(groups[i]) <= counts[i]:
            break  # every stack holds one trial
        counts[i] += 1
    out = []
    for group, count in zip(groups, counts):
        size, extra = divmod(len(group), count)
        start = 0
        for i in range(count):
            end = start + size + (i < extra)
            out.append(tuple(group[start:end]))
            start = end
    order = {id(item): i for i, item in enumerate(items)}
    return sorted(out, key=lambda stack: order[id(stack[0])])
