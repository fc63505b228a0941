"""Expand a validated spec into its grid of typed ``Trial``s, computed once: resolved models,
budgets (steps, tokens, FLOPs, parameters, from the workload), batch geometry and trial ids.
Also how many trials fit on the cluster at once, and the plan as a table. Trains nothing."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from orchestrator.spec import ExperimentSpec
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


def trial_id(spec: ExperimentSpec, model: ModelConfig, dataset: str, lr: float, seed: int,
             tokens: int, data: Any = None, code: str | None = None) -> str:
    """Hash of a trial's scientific identity: workload, dataset, model, data (with ``data``,
    the prepared data: a corpus's content), budget, batch, optimizer, schedule and precision
    (``workloads.core.config.science``, the precision as planned), learning rate, seed and the
    code that computes it (``code``, default ``code_fingerprint()``); not its resources,
    micro-batching, logging, ZeRO stage or compiling."""
    training = science(spec.budget, spec.training, spec.optimizer, spec.schedule,
                       planned_engine(spec).precision)
    identity = {"workload": spec.workload, "dataset": dataset, "model": model.to_dict(),
                "data": spec.workload_impl.identity(spec.workload_config, data),
                "training": training,
                "lr": lr, "seed": seed, "tokens": tokens, "code": code or code_fingerprint()}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]


def plan(spec: ExperimentSpec, data: Any = None) -> list[Trial]:
    """Every dataset x size x variant x learning rate x seed of ``spec``, in that order.

    ``data`` is the workload's prepared data (``Workload.prepare``); with it, models get the
    prepared vocabulary (a tokenizer's real size), without it the spec's.
    """
    workload = spec.workload_impl
    config = spec.workload_config
    vocab = workload.vocab_size(config, data)
    micro, accum = batch_geometry(spec.training, spec.resources, workload.micro_batches)
    engine = planned_engine(spec)
    trials = []
    for dataset in workload.datasets(config):
        for size in spec.sizes:
            for variant, overrides in spec.variants.items():
                model = overrides.resolve(size, vocab)
                budget = workload.budget(config, spec.budget, spec.training, size, model)
                for lr in spec.learning_rates:
                    for seed in spec.seeds:
                        trials.append(Trial(
                            trial_id(spec, model, dataset, lr, seed, budget.units, data),
                            spec.workload, dataset, variant, size, lr, seed, model, config,
                            training=spec.training, optimizer=spec.optimizer,
                            schedule=spec.schedule, engine=engine, resources=spec.resources,
                            budget=budget, micro_batch_size=micro, grad_accum=accum))
    return trials


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


def format_plan(spec: ExperimentSpec, trials: list[Trial],
                wall_s: dict[str, float] | None = None, slots: int = 1) -> str:
    """The grid as a table (one row per trial, ``#`` its row number) with totals.

    ``mem/GPU`` (``mem/worker`` on CPUs) is the workload's ``memory`` estimate (the language
    model's: weights, gradients and optimizer states under the trial's ZeRO stage plus one
    micro-batch's activations; ``-`` where it has none). ``wall_s`` maps trial ids to estimated wall
    seconds (``orchestrator.calibrate``); the total wall time runs them in order on ``slots`` slots,
    each trial taking the first free one (as Ray Tune schedules a grid).
    """
    workload = spec.workload_impl
    unit = workload.unit
    several = len({t.dataset for t in trials}) > 1
    rows = [{"#": i, "trial": t.trial_id, **({"dataset": t.dataset} if several else {}),
             "variant": t.variant, "size": t.size, "lr": f"{t.lr:g}", "seed": t.seed,
             "params": t.params["total"], "non-emb": t.params["non_embedding"],
             "attn": t.params["attention"], "mlp": t.params["mlp"], unit: t.tokens,
             "steps": t.steps, "FLOPs": f"{t.budget.flops:.3g}",
             f"mem/{'GPU' if t.resources.use_gpu else 'worker'}": _bytes(workload.memory(
                 t.model, t.engine, t.resources, t.micro_batch_size)),
             **({"est. wall": _duration(wall_s[t.trial_id])} if wall_s else {})}
            for i, t in enumerate(trials)]
    r, tr, first = spec.resources, spec.training, trials[0]
    zero_stage, precision = first.engine.zero_stage, first.engine.precision
    head = (f"experiment {spec.name} ({spec.workload}): {len(trials)} trial(s); each "
            f"{r.num_workers} worker(s) x {r.cpus_per_worker} CPU{' + 1 GPU' if r.use_gpu else ''}"
            f", ZeRO {zero_stage}, {precision}, global batch {tr.batch_size} = "
            f"{first.micro_batch_size} per micro-batch x {first.grad_accum} accumulation x "
            f"{r.num_workers} worker(s)")
    total = (f"total: {sum(t.tokens for t in trials):,} {unit}, "
             f"{sum(t.steps for t in trials):,} steps, "
             f"{sum(t.budget.flops for t in trials):.3g} FLOPs")
    if wall_s:
        free = [0.0] * slots
        for t in trials:
            free[free.index(min(free))] += wall_s[t.trial_id]
        total += f", est. wall {_duration(max(free))} ({slots} trial(s) at once)"
    return "\n".join([head, format_table(rows), total])


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
