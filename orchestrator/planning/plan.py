"""Expand a validated spec into its grid of typed ``Trial``s, computed once: resolved models,
budgets (steps, tokens, FLOPs, parameters, from the workload), batch geometry and trial ids.
Also how many trials fit on the cluster at once, and the plan as a table. Trains nothing."""

from __future__ import annotations

import functools
import hashlib
import heapq
import json
import os
from collections.abc import Callable
from typing import Any

from orchestrator.planning.spec import ExperimentSpec
from orchestrator.planning.stacks import form_stacks
from orchestrator.table import format_table
from workloads.core.architecture import ModelConfig
from workloads.core.config import EngineConfig, ResourcesConfig, TrainingConfig, science
from workloads.core.precision import planned_precision
from workloads.core.provenance import code_fingerprint
from workloads.core.trial import Trial


def batch_geometry(training: TrainingConfig, resources: ResourcesConfig,
                   micro_batches: bool = True) -> tuple[int, int]:
    """``(micro_batch_size, grad_accum)`` per worker: the largest micro-batch <=
    ``training.micro_batch_size`` that divides the worker's share of the global batch, or the
    whole share in one pass for a workload that does not micro-batch."""
    share = training.batch_size // resources.num_workers
    if not micro_batches:
        return share, 1
    micro = max(m for m in range(1, min(share, training.micro_batch_size) + 1) if share % m == 0)
    return micro, share // micro


def planned_engine(spec: ExperimentSpec) -> EngineConfig:
    """``spec.engine`` as its trials run it: ``precision: auto`` fixed to bf16 or fp32
    (``workloads.core.precision.planned_precision``), so that a trial's identity and its MLflow
    params say which one it trained in, and workers on other hardware train in the same."""
    precision = planned_precision(spec.engine.precision, spec.resources.use_gpu)
    return spec.engine.model_copy(update={"precision": precision})


def trial_ids(spec: ExperimentSpec, model: ModelConfig, dataset: str, tokens: int,
              data: Any = None, code: str | None = None) -> Callable[[float, int], str]:
    """``trial_id`` of each learning rate and seed of ``model`` on ``dataset``: the identity
    without them is serialized once, and each call only splices its two numbers in (planning
    a grid of 100,000s of trials takes seconds)."""
    training = science(spec.budget, spec.training, spec.optimizer, spec.schedule,
                       planned_engine(spec).precision, spec.engine.deepspeed)
    identity = {"workload": spec.workload, "dataset": dataset, "model": model.to_dict(),
                "data": spec.workload_impl.identity(spec.workload_config, data),
                "training": training, "lr": _LR, "seed": _SEED, "tokens": tokens,
                "code": code or code_fingerprint()}
    head, rest = json.dumps(identity, sort_keys=True).split(json.dumps(_LR))
    middle, tail = rest.split(json.dumps(_SEED))

    def trial_id_of(lr: float, seed: int) -> str:
        text = head + _json(lr) + middle + _json(seed) + tail
        return hashlib.sha256(text.encode()).hexdigest()[:12]
    return trial_id_of


_LR, _SEED = "<lr>", "<seed>"  # stand-ins in the serialized identity, replaced per trial
_json = functools.lru_cache(maxsize=4096, typed=True)(json.dumps)  # a grid's few numbers


def trial_id(spec: ExperimentSpec, model: ModelConfig, dataset: str, lr: float, seed: int,
             tokens: int, data: Any = None, code: str | None = None) -> str:
    """Hash of a trial's scientific identity: workload, dataset, model, data (with ``data``,
    the prepared data: a corpus's content), budget, batch, optimizer, schedule and precision
    (``workloads.core.config.science``, the precision as planned), learning rate, seed and the
    code that computes it (``code``, default ``code_fingerprint()``); not its resources,
    micro-batching, logging, ZeRO stage or compiling: the sha256 of the identity as JSON
    (sorted keys), 12 hex digits."""
    return trial_ids(spec, model, dataset, tokens, data, code)(lr, seed)


Cell = Callable[[float, int], Trial]  # one dataset x size x variant: its trial of an lr and seed


def cells(spec: ExperimentSpec, data: Any = None) -> list[Cell]:
    """The dataset x size x variant cells of ``spec``'s grid, in that order, each the function
    that plans its trial of a learning rate and seed (the model, budget and most of the trial id
    resolved once per cell).

    ``data`` is the workload's prepared data (``Workload.prepare``); with it, models get the
    prepared vocabulary (a tokenizer's real size), without it the spec's.
    """
    workload = spec.workload_impl
    config = spec.workload_config
    vocab = workload.vocab_size(config, data)
    micro, accum = batch_geometry(spec.training, spec.resources, workload.micro_batches)
    engine = planned_engine(spec)

    def cell(dataset: str, size: str, variant: str) -> Cell:
        model = spec.variants[variant].resolve(size, vocab)
        budget = workload.budget(config, spec.budget, spec.training, size, model)
        trial_id_of = trial_ids(spec, model, dataset, budget.units, data)

        def trial(lr: float, seed: int) -> Trial:
            return Trial(trial_id_of(lr, seed), spec.workload, dataset, variant, size, lr, seed,
                         model, config, training=spec.training, optimizer=spec.optimizer,
                         schedule=spec.schedule, engine=engine, resources=spec.resources,
                         budget=budget, micro_batch_size=micro, grad_accum=accum)
        return trial
    return [cell(dataset, size, variant) for dataset in workload.datasets(config)
            for size in spec.sizes for variant in spec.variants]


def arm_cells(spec: ExperimentSpec, data: Any = None) -> dict[tuple[str, str, str], Cell]:
    """``cells`` keyed by arm: ``(dataset, variant, size)``."""
    arms = [(dataset, variant, size)
            for dataset in spec.workload_impl.datasets(spec.workload_config)
            for size in spec.sizes for variant in spec.variants]
    return dict(zip(arms, cells(spec, data), strict=True))


def plan(spec: ExperimentSpec, data: Any = None) -> list[Trial]:
    """Every dataset x size x variant x learning rate x seed of ``spec``, in that order
    (``cells`` with ``data``, each over the learning rates and seeds)."""
    return [trial(lr, seed) for trial in cells(spec, data)
            for lr in spec.lr_grid for seed in spec.seeds]


def capacity() -> tuple[float, float, float]:
    """``(CPUs, GPUs, GiB of memory)`` that trials can use: the connected Ray cluster's, or,
    with no Ray connection, this machine's (what a local Ray instance gets: the memory
    available now, less Ray's object store)."""
    import ray

    if ray.is_initialized():
        total = ray.cluster_resources()
        return total.get("CPU", 0.0), total.get("GPU", 0.0), total.get("memory", 0.0) / 2**30
    import psutil
    import torch

    available = psutil.virtual_memory().available
    object_store = min(0.3 * available, 200 * 2**30)  # Ray's default object store share
    return (float(os.cpu_count() or 1), float(torch.cuda.device_count()),
            (available - object_store) / 2**30)


def concurrency(spec: ExperimentSpec) -> int:
    """How many trials of ``spec`` Ray Tune runs at once on ``capacity()``."""
    return spec.resources.trials_that_fit(*capacity())


SUMMARY_ABOVE = 1000  # a larger grid is planned as a summary: a row per cell, not per trial


def format_plan(spec: ExperimentSpec, trials: list[Trial],
                wall_s: dict[str, float] | None = None, slots: int = 1,
                cached: set[str] | None = None) -> str:
    """The grid as a table (one row per trial, ``#`` its row number) with totals.

    ``cached`` holds the ids of trials that the ledger has FINISHED, in this experiment or
    another (``Ledger.finished_hashes``): they are marked ``cached``, counted in a last line,
    and take no wall time, since ``run`` copies them rather than training them.

    ``mem/GPU`` (``mem/worker`` on CPUs) is the workload's ``memory`` estimate (the language
    model's: weights, gradients and optimizer states under the trial's ZeRO stage plus one
    micro-batch's activations; ``-`` where it has none). ``wall_s`` maps trial ids to estimated wall
    seconds (``orchestrator.planning.calibrate``); the total wall time runs them in order on
    ``slots`` slots, each trial taking the first free one (as Ray Tune schedules a grid).

    Trials that train as one stacked model (``orchestrator.planning.stacks``, with ``slots`` at
    once) get a ``stack`` column (its number) and a last line counting them.
    """
    several = len({t.dataset for t in trials}) > 1
    rows = [_row(spec, i, t, several, wall_s) for i, t in enumerate(trials)]
    pending = [t for t in trials if not (cached and t.trial_id in cached)]
    stacks = form_stacks(pending, lambda t: t, spec.workload_impl, slots)
    stacked = [s for s in stacks if len(s) > 1]
    if stacked:
        number = {t.trial_id: i for i, s in enumerate(stacks, 1) for t in s}
        for row, t in zip(rows, trials, strict=True):
            row["stack"] = number.get(t.trial_id, "")
    if cached is not None:
        for row, t in zip(rows, trials, strict=True):
            row["cache"] = "cached" if t.trial_id in cached else ""
    walls = [0.0 if cached and t.trial_id in cached else wall_s[t.trial_id] for t in trials] \
        if wall_s else None
    lines = [_head(spec, trials[0], len(trials)), format_table(rows),
             _total(spec, [(t, 1) for t in trials], walls, slots)]
    if stacked:
        sizes = sorted({len(s) for s in stacked})
        lines.append(f"stacks: {sum(map(len, stacked)):,} of {len(pending):,} trial(s) to "
                     f"train in {len(stacked):,} stack(s) of {sizes[0]}"
                     f"{f'-{sizes[-1]}' if len(sizes) > 1 else ''}, each one stacked model on "
                     "one worker (resources.stack caps them; est. wall: a trial's share of its "
                     "stack's)")
    if cached is not None:
        n = sum(t.trial_id in cached for t in trials)
        lines.append(f"cached: {n:,} of {len(trials):,} trial(s) finished in the ledger already; "
                     "run copies them from the experiment that trained them (--no-cache trains "
                     "those of other experiments again)")
    return "\n".join(lines)


def format_summary(spec: ExperimentSpec, grid: list[Cell],
                   wall_s: dict[str, float] | None = None, slots: int = 1) -> str:
    """A grid too large to list (more than ``SUMMARY_ABOVE`` trials) as one row per cell of
    ``cells`` (its trial count, learning-rate range and seeds; params, tokens, steps, FLOPs,
    memory and est. wall of each of its trials), the grid's first and last trials as
    ``format_plan`` rows, and the totals. Plans one trial per cell, not the grid.

    ``wall_s`` maps each cell's first trial id (its first learning rate and seed) to the estimated
    wall seconds that every trial of the cell takes.
    """
    lrs, seeds = spec.lr_grid, spec.seeds
    firsts = [trial(lrs[0], seeds[0]) for trial in grid]
    several = len({t.dataset for t in firsts}) > 1
    per_cell = len(lrs) * len(seeds)
    rows = []
    for t in firsts:
        row = _row(spec, 0, t, several, wall_s)
        for key in ("#", "trial", "lr", "seed"):
            del row[key]
        rows.append({**({"dataset": t.dataset} if several else {}), "variant": t.variant,
                     "size": t.size, "trials": per_cell,
                     "lr": f"{min(lrs):g}..{max(lrs):g} ({len(lrs)})", "seeds": len(seeds),
                     **{k: v for k, v in row.items() if k not in ("dataset", "variant", "size")}})
    n = per_cell * len(grid)
    last = grid[-1](lrs[-1], seeds[-1])
    if wall_s:
        wall_s = {**wall_s, last.trial_id: wall_s[firsts[-1].trial_id]}
    ends = [_row(spec, 0, firsts[0], several, wall_s), _row(spec, n - 1, last, several, wall_s)]
    walls = [wall_s[t.trial_id] for t in firsts] if wall_s else None
    return "\n".join([_head(spec, firsts[0], n), format_table(rows),
                      "first and last trials:", format_table(ends),
                      _total(spec, [(t, per_cell) for t in firsts], walls, slots)])


def _head(spec: ExperimentSpec, first: Trial, n: int) -> str:
    r, tr = spec.resources, spec.training
    head = (f"experiment {spec.name} ({spec.workload}): {n:,} trial(s); each "
            f"{r.num_workers} worker(s) x {r.cpus_per_worker} CPU{' + 1 GPU' if r.use_gpu else ''}"
            f", ZeRO {first.engine.zero_stage}, {first.engine.precision}, global batch "
            f"{tr.batch_size} = {first.micro_batch_size} per micro-batch x {first.grad_accum} "
            f"accumulation x {r.num_workers} worker(s)")
    if spec.lr_max_points is None:
        return head
    lrs, arms = spec.lr_grid, n // (len(spec.lr_grid) * len(spec.seeds))
    more = (spec.lr_max_points - len(lrs)) * arms * len(spec.seeds)
    return (f"{head}\nlearning rates adapt: an arm whose validation optimum sits at an edge of "
            f"{lrs[0]:g}..{lrs[-1]:g} gets the next point beyond it (a factor "
            f"{lrs[1] / lrs[0]:.3g} below, {lrs[-1] / lrs[-2]:.3g} above), round after round, "
            f"up to {spec.lr_max_points} per arm: at most {more:,} more trial(s)")


def _row(spec: ExperimentSpec, i: int, t: Trial, several: bool,
         wall_s: dict[str, float] | None) -> dict[str, Any]:
    workload = spec.workload_impl
    return {"#": i, "trial": t.trial_id, **({"dataset": t.dataset} if several else {}),
            "variant": t.variant, "size": t.size, "lr": f"{t.lr:g}", "seed": t.seed,
            "params": t.params["total"], "non-emb": t.params["non_embedding"],
            "attn": t.params["attention"], "mlp": t.params["mlp"], workload.unit: t.tokens,
            "steps": t.steps, "FLOPs": f"{t.budget.flops:.3g}",
            f"mem/{'GPU' if t.resources.use_gpu else 'worker'}": _bytes(workload.memory(
                t.model, t.engine, t.resources, t.micro_batch_size, t.config)),
            **({"est. wall": _duration(wall_s[t.trial_id])} if wall_s else {})}


def _total(spec: ExperimentSpec, counted: list[tuple[Trial, int]], walls: list[float] | None,
           slots: int) -> str:
    """Totals of ``(trial, how many such trials)`` in grid order; with ``walls`` (each one's wall
    seconds), the wall time of running them in order on ``slots`` slots, each trial taking the
    first free one (as Ray Tune schedules a grid)."""
    total = (f"total: {sum(t.tokens * k for t, k in counted):,} {spec.workload_impl.unit}, "
             f"{sum(t.steps * k for t, k in counted):,} steps, "
             f"{sum(t.budget.flops * k for t, k in counted):.3g} FLOPs")
    if walls is not None:
        free = [0.0] * slots  # a heap of the slots' busy-until times
        for (_, k), wall in zip(counted, walls, strict=True):
            for _ in range(k):
                heapq.heapreplace(free, free[0] + wall)
        total += f", est. wall {_duration(max(free))} ({slots} trial(s) at once)"
    return total


def _bytes(estimate) -> str:
    if estimate is None:
        return "-"
    n = estimate.total
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f}m"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"
