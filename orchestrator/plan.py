"""Expand a spec into trials and describe them, without running anything."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

from orchestrator.spec import ExperimentSpec
from orchestrator.table import format_table
from workloads.models import ModelConfig, build_model, count_parameters, flops_per_token
from workloads.train import steps_for


@dataclass(frozen=True)
class Trial:
    """One training run of the grid: a model config trained on the spec's data and budget."""

    trial_id: str
    variant: str
    size: str
    model: ModelConfig
    params: dict[str, int]
    tokens: int
    steps: int
    flops: float  # training FLOPs of the whole trial (forward + backward)


def parameter_counts(cfg: ModelConfig) -> dict[str, int]:
    """``count_parameters`` of the model ``cfg`` describes, built on the meta device (no memory)."""
    with torch.device("meta"):
        return count_parameters(build_model(cfg))


def trial_id(spec: ExperimentSpec, model: ModelConfig) -> str:
    """Hash of a trial's scientific identity: model, data and training (not its resources)."""
    identity = {"model": model.to_dict(), "data": spec.data.model_dump(),
                "training": spec.training.model_dump()}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]


def plan_trials(spec: ExperimentSpec, vocab_size: int | None = None) -> list[Trial]:
    """Every size x variant of ``spec``, in spec order.

    ``vocab_size`` (the trained tokenizer's size) replaces ``data.vocab_size`` when given.
    """
    trials = []
    for size in spec.sizes:
        for variant in spec.variants:
            model = spec.resolve_model(size, variant)
            if vocab_size is not None:
                model = ModelConfig(**{**model.to_dict(), "vocab_size": vocab_size})
            steps = steps_for(spec.training.tokens, spec.training.batch_size,
                              model.context_length)
            tokens = steps * spec.training.batch_size * model.context_length
            trials.append(Trial(trial_id(spec, model), variant, size, model,
                                parameter_counts(model), tokens, steps,
                                flops_per_token(model, model.context_length) * tokens))
    return trials


def format_plan(spec: ExperimentSpec, trials: list[Trial]) -> str:
    rows = [{"trial": t.trial_id, "variant": t.variant, "size": t.size,
             "attention": t.model.attention, "mlp": t.model.mlp,
             "params": t.params["total"], "non-emb": t.params["total"] - t.params["embedding"],
             "attn": t.params["attention"], "mlp params": t.params["mlp"],
             "tokens": t.tokens, "steps": t.steps, "TFLOPs": round(t.flops / 1e12, 2)}
            for t in trials]
    head = (f"experiment {spec.name}: {len(trials)} trial(s), "
            f"{spec.resources.num_workers} worker(s) each, ZeRO {spec.training.zero_stage}, "
            f"global batch {spec.training.batch_size} x {trials[0].model.context_length} tokens")
    total = (f"total: {sum(t.tokens for t in trials):,} tokens, "
             f"{sum(t.steps for t in trials):,} steps, {sum(t.flops for t in trials):.3g} FLOPs")
    return "\n".join([head, format_table(rows, list(rows[0])), total])
