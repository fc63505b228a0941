"""Expand a spec into its grid of trials and describe them, without training anything."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

import torch

from orchestrator.spec import ExperimentSpec
from orchestrator.table import format_table
from workloads.gp import GPRegressor, gp_flops_per_sample
from workloads.models import ModelConfig, build_model, count_parameters, flops_per_token
from workloads.train import steps_for

# Engine options and logging that do not change what a trial computes: left out of its identity.
_NOT_SCIENCE = {"micro_batch_size", "log_interval", "energy_diagnostics", "zero_stage"}


@dataclass(frozen=True)
class Trial:
    """One training run of the grid.

    ``tokens`` counts training tokens (examples for the GP workload); ``flops`` the forward +
    backward FLOPs of the whole trial; ``params`` the ``count_parameters`` roles plus
    ``non_embedding``.
    """

    trial_id: str
    dataset: str
    variant: str
    size: str
    lr: float
    seed: int
    model: ModelConfig
    params: dict[str, int]
    tokens: int
    steps: int
    flops: float
    micro_batch_size: int
    grad_accum: int

    @property
    def label(self) -> str:
        return f"{self.variant}@{self.size} lr={self.lr:g} seed={self.seed}"


def parameter_counts(cfg: ModelConfig, gp_input_dim: int | None = None) -> dict[str, int]:
    """``count_parameters`` roles and ``non_embedding`` of the model ``cfg`` describes (a
    ``GPRegressor`` when ``gp_input_dim`` is given), built on the meta device (no memory)."""
    with torch.device("meta"):
        if gp_input_dim is None:
            counts = count_parameters(build_model(cfg))
        else:
            model = GPRegressor(cfg, gp_input_dim)
            mlp = sum(p.numel() for p in model.blocks.parameters())
            total = sum(p.numel() for p in model.parameters())
            counts = {"total": total, "embedding": 0, "attention": 0, "mlp": mlp,
                      "other": total - mlp}
    return {**counts, "non_embedding": counts["total"] - counts["embedding"]}


def trial_id(spec: ExperimentSpec, model: ModelConfig, dataset: str, lr: float, seed: int,
             tokens: int) -> str:
    """Hash of a trial's scientific identity: workload, dataset, model, data, budget, optimizer,
    learning rate and seed; not its resources, micro-batching or logging."""
    data = spec.gp.model_dump(exclude={"kernels"}) if spec.workload == "gp_regression" else (
        spec.data.model_dump())
    identity = {"workload": spec.workload, "dataset": dataset, "model": model.to_dict(),
                "data": data, "training": spec.training.model_dump(exclude=_NOT_SCIENCE),
                "lr": lr, "seed": seed, "tokens": tokens}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]


def token_budget(spec: ExperimentSpec, size: str, vocab_size: int | None = None) -> int:
    """``training.tokens``, else Chinchilla: ``tokens_per_param`` x total parameters of the
    Llama baseline of ``size`` x ``budget_scale`` (paper Sec. 4, App. C.3)."""
    t = spec.training
    if t.tokens is not None:
        return t.tokens
    baseline = parameter_counts(spec.baseline_model(size, vocab_size))["total"]
    return max(1, round(t.tokens_per_param * baseline * t.budget_scale))


def plan_trials(spec: ExperimentSpec, vocab_size: int | None = None) -> list[Trial]:
    """Every dataset x size x variant x learning rate x seed of ``spec``, in that order.

    ``vocab_size`` (the prepared tokenizer's size) replaces ``data.vocab_size`` when given.
    A language-model trial runs ``ceil(budget / (batch_size x context_length))`` steps; a GP
    trial ``gp.steps`` steps of ``batch_size`` examples.
    """
    micro, accum = spec.training.micro_batch(spec.resources.num_workers)
    gp = spec.workload == "gp_regression"
    trials = []
    for dataset in spec.datasets():
        for size in spec.sizes:
            budget = None if gp else token_budget(spec, size, vocab_size)
            for variant in spec.variants:
                model = spec.resolve_model(size, variant)
                if vocab_size is not None:
                    model = dataclasses.replace(model, vocab_size=vocab_size)
                if gp:
                    steps = spec.gp.steps
                    tokens = steps * spec.training.batch_size
                    per_token = gp_flops_per_sample(model, spec.gp.input_dim)
                    params = parameter_counts(model, spec.gp.input_dim)
                else:
                    steps = steps_for(budget, spec.training.batch_size, model.context_length)
                    tokens = steps * spec.training.batch_size * model.context_length
                    per_token = flops_per_token(model, model.context_length)
                    params = parameter_counts(model)
                for lr in spec.learning_rates:
                    for seed in spec.seeds:
                        trials.append(Trial(
                            trial_id(spec, model, dataset, lr, seed, tokens), dataset, variant,
                            size, lr, seed, model, params, tokens, steps, per_token * tokens,
                            micro, accum))
    return trials


def format_plan(spec: ExperimentSpec, trials: list[Trial],
                wall_s: dict[str, float] | None = None, concurrency: int = 1) -> str:
    """The grid as a table (one row per trial) with totals.

    ``wall_s`` maps trial ids to estimated wall seconds (``orchestrator.calibrate``); the total
    wall time runs them in order on ``concurrency`` slots, each trial taking the first free one
    (as Ray Tune schedules a grid).
    """
    gp = spec.workload == "gp_regression"
    rows = [{"trial": t.trial_id, **({"dataset": t.dataset} if gp else {}),
             "variant": t.variant, "size": t.size, "lr": f"{t.lr:g}", "seed": t.seed,
             "params": t.params["total"], "non-emb": t.params["non_embedding"],
             "attn": t.params["attention"], "mlp": t.params["mlp"],
             "examples" if gp else "tokens": t.tokens, "steps": t.steps,
             "FLOPs": f"{t.flops:.3g}",
             **({"est. wall": _duration(wall_s[t.trial_id])} if wall_s else {})}
            for t in trials]
    r, tr = spec.resources, spec.training
    unit = "examples" if gp else "sequences"
    head = (f"experiment {spec.name} ({spec.workload}): {len(trials)} trial(s); each "
            f"{r.num_workers} worker(s) x {r.cpus_per_worker} CPU{' + 1 GPU' if r.use_gpu else ''}"
            f", ZeRO {tr.zero_stage}, global batch {tr.batch_size} {unit} = "
            f"{trials[0].micro_batch_size} per micro-batch x {trials[0].grad_accum} accumulation "
            f"x {r.num_workers} worker(s)")
    total = (f"total: {sum(t.tokens for t in trials):,} {'examples' if gp else 'tokens'}, "
             f"{sum(t.steps for t in trials):,} steps, {sum(t.flops for t in trials):.3g} FLOPs")
    if wall_s:
        slots = [0.0] * concurrency
        for t in trials:
            slots[slots.index(min(slots))] += wall_s[t.trial_id]
        total += f", est. wall {_duration(max(slots))} ({concurrency} trial(s) at once)"
    return "\n".join([head, format_table(rows, list(rows[0])), total])


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f}m"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"
