"""``cemlab train``: one trial in this process, no Ray, no MLflow, no ledger.

    cemlab train --preset nano --steps 50                 # a language model, Shakespeare
    cemlab train --spec SPEC.yaml --trial 3               # trial 3 of a spec's plan
    cemlab train --spec SPEC.yaml --trial 3f2a9c1b        # ... or by its trial id
    cemlab train --spec SPEC.yaml --trial 3 --metrics-json m.json   # every metric to a file
    cemlab train --spec SPEC.yaml --trial 0,1,2,3         # four trials as one stacked model
    cemlab train --preset llama-134m --engine deepspeed --zero-stage 1
    cemlab train --preset micro --engine deepspeed --profile 20     # a whole step's kernels

``--spec`` plans the spec exactly as ``cemlab plan`` does (``#`` is the plan's row, from 0);
``--preset`` plans a one-trial language-model spec of that preset on the embedded Shakespeare
(or ``--corpus``'s text files). The trial runs on one worker with the plain PyTorch engine, or
with ``--engine deepspeed`` DeepSpeed's on a process group of this one process, as a one-worker
Ray trial runs it. ``--zero-stage`` and ``--compile`` replace the trial's ``engine.zero_stage``
and ``engine.compile``. It prints the loss as it trains, then the workload's report. Several
trials (``--trial`` rows or ids, comma-separated) that differ in learning rate and seed only
train as one stacked model on the plain PyTorch engine (``workloads.runtime.stacked``), each
with the metrics it has alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging

from pydantic import ValidationError

from orchestrator.planning.plan import batch_geometry, plan
from orchestrator.planning.spec import ExperimentSpec, SpecError, load_spec, parse_spec
from workloads.core.architecture import PRESETS
from workloads.core.config import EngineConfig, deep_merged
from workloads.core.paths import Paths
from workloads.core.trial import Job, stack_key

ENGINES = ("torch", "deepspeed")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``cemlab train``."""
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--preset", choices=sorted(PRESETS), help="a model preset (llama-* and "
                      "the CPU sizes are Llama, cem-* the paper's best CEM; --attention/--mlp "
                      "override)")
    what.add_argument("--spec", help="an experiment spec; pick the trial with --trial")
    parser.add_argument("--trial", help="with --spec: the plan's row number or a trial id; "
                        "several, comma-separated, train as one stacked model")
    parser.add_argument("--steps", type=int, help="optimizer steps (default: the trial's "
                        "budget with --spec, 100 with --preset)")
    parser.add_argument("--attention", choices=["llama", "cem"],
                        help="the sublayer kind (--preset; default: the preset's)")
    parser.add_argument("--mlp", choices=["llama", "cem"], help="(--preset; default: the "
                        "preset's)")
    parser.add_argument("--lr", type=float, default=0.002, help="peak learning rate (--preset)")
    parser.add_argument("--seed", type=int, default=0, help="(--preset)")
    parser.add_argument("--batch-size", type=int, default=16,
                        help="sequences per step (--preset)")
    parser.add_argument("--corpus", default=None, help="a glob of text files (--preset; "
                        "default: the embedded Shakespeare)")
    parser.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="fp32",
                        help="(--preset)")
    parser.add_argument("--engine", choices=ENGINES, default="torch",
                        help="plain PyTorch, or DeepSpeed ZeRO on a one-process group (what a "
                        "Ray worker runs)")
    parser.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3],
                        help="DeepSpeed's ZeRO stage (default: the trial's)")
    parser.add_argument("--compile", choices=["auto", "true", "false"],
                        help="torch.compile the model and loss; auto: on a GPU at ZeRO 0-2 "
                        "(default: the trial's)")
    parser.add_argument("--deepspeed", type=json.loads, metavar="JSON",
                        help="more DeepSpeed config over the trial's engine.deepspeed, e.g. "
                        "'{\"bf16\": {\"check_grad_overflow\": false}}'")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="profile train steps 4 and 5 and print their N longest GPU kernels "
                        "(torch operators on a CPU), their wall and busy time per step")
    parser.add_argument("--metrics-json", metavar="PATH",
                        help="also write every logged metric (and the final ones) to PATH")


def preset_spec(args: argparse.Namespace) -> ExperimentSpec:
    """A one-trial language-model spec of ``args.preset``: its sublayer kinds replaced only
    where ``--attention``/``--mlp`` name one (``--preset cem-134m`` is the paper's best CEM),
    ``args.steps`` (default 100) steps of ``args.batch_size`` sequences on the preset's
    vocabulary, four validations of 64 sequences, on one worker."""
    preset, steps = PRESETS[args.preset], args.steps or 100
    kinds = {k: v for k, v in (("attention", args.attention), ("mlp", args.mlp)) if v}
    variant = f"{kinds.get('attention', preset.attention)}-{kinds.get('mlp', preset.mlp)}"
    data = {"vocab_size": preset.vocab_size,
            **({"source": "text_files", "paths": args.corpus} if args.corpus else {})}
    return parse_spec({
        "name": f"train-{args.preset}", "workload": "language_model", "data": data,
        "sizes": [args.preset], "variants": {variant: kinds}, "learning_rates": [args.lr],
        "seeds": [args.seed],
        "budget": {"tokens": steps * args.batch_size * preset.context_length},
        "training": {"batch_size": args.batch_size, "micro_batch_size": args.batch_size,
                     "eval_interval": max(steps // 4, 1), "eval_sequences": 64},
        "engine": {"precision": args.precision},
        "resources": {"num_workers": 1}}, f"--preset {args.preset}")


def spec_job(spec: ExperimentSpec, trial: str, data_dir: str, source: str = "the spec") -> Job:
    """Trial ``trial`` (row or id) of ``spec``'s plan (read from ``source``), with its prepared
    data, on one worker:
    ``micro_batch_size x grad_accum`` is the spec's whole ``batch_size``, whatever
    ``resources.num_workers`` the plan has (its id stays the plan's).

    Raises:
        SpecError: no such trial (one line naming it).
    """
    workload = spec.workload_impl
    trials = plan(spec)  # first without data: a wrong row fails before any download
    wrong = SpecError(f"--trial {trial!r}: not a row (0..{len(trials) - 1}) or trial id of "
                      f"{source}")
    maybe_id = len(trial) == len(trials[0].trial_id)  # an id may be digits only
    row = not maybe_id and trial.isdigit() and int(trial) < len(trials)
    if not (row or maybe_id):
        raise wrong
    prepared = workload.prepare(spec.workload_config, data_dir)
    planned = plan(spec, prepared.data)  # ids as `run` has them (they cover the corpus)
    index = int(trial) if row else next(
        (i for i, t in enumerate(planned) if trial in (t.trial_id, trials[i].trial_id)), None)
    if index is None:
        raise wrong
    # This process is the trial's only worker: it takes the whole global batch per step, as
    # the planned workers do together (the same micro-batch size, their share accumulated).
    chosen = planned[index]
    one = chosen.resources.model_copy(update={"num_workers": 1})
    micro, accum = batch_geometry(chosen.training, one, workload.micro_batches)
    return Job(dataclasses.replace(chosen, resources=one, micro_batch_size=micro,
                                   grad_accum=accum), prepared.data)


def with_steps(job: Job, steps: int) -> Job:
    """``job`` cut (or extended) to ``steps`` optimizer steps."""
    trial = job.trial
    units = trial.budget.units * steps // trial.steps
    budget = dataclasses.replace(trial.budget, steps=steps, units=units,
                                 flops=trial.budget.flops * steps / trial.steps)
    return dataclasses.replace(job, trial=dataclasses.replace(trial, budget=budget))


def with_engine_options(job: Job, zero_stage: int | None, compiles: str | None,
                        deepspeed: dict | None = None) -> Job:
    """``job`` with ``engine.zero_stage`` and ``engine.compile`` replaced where given
    (``compiles``: ``auto``, ``true`` or ``false``) and ``deepspeed`` merged key by key over
    ``engine.deepspeed``, for this in-process run: the trial keeps its planned id.

    Raises:
        SpecError: ``deepspeed`` is not a mapping, or sets a key another engine field owns (one
            line).
    """
    if deepspeed is not None and not isinstance(deepspeed, dict):
        raise SpecError("--deepspeed: give a JSON object of DeepSpeed config keys")
    update = {**({"zero_stage": zero_stage} if zero_stage is not None else {}),
              **({"compile": {"true": True, "false": False}.get(compiles, compiles)}
                 if compiles is not None else {}),
              **({"deepspeed": deep_merged(job.trial.engine.deepspeed, deepspeed)}
                 if deepspeed else {})}
    if not update:
        return job
    try:
        engine = EngineConfig.model_validate({**job.trial.engine.model_dump(), **update})
    except ValidationError as e:
        problem = e.errors()[0]["msg"].removeprefix("Value error, ")
        raise SpecError(f"--deepspeed: {problem}") from None
    return dataclasses.replace(job, trial=dataclasses.replace(job.trial, engine=engine))


def train(args: argparse.Namespace) -> dict[str, float]:
    """Plan ``args``' trial, train it here and print its report; returns its final metrics.

    Raises:
        SpecError: an invalid spec or preset, or no such trial (one line).
    """
    if (args.spec is None) != (args.trial is None):
        raise SpecError("--spec and --trial go together (--trial: a row of `cemlab plan SPEC`"
                        " or a trial id)")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    spec = load_spec(args.spec) if args.spec else preset_spec(args)
    rows = (args.trial or "0").split(",")
    jobs = [spec_job(spec, row.strip(), str(Paths().data_dir), args.spec or args.preset)
            for row in rows]
    if args.spec and args.steps:
        jobs = [with_steps(job, args.steps) for job in jobs]
    if args.deepspeed is not None and args.engine != "deepspeed":
        raise SpecError("--deepspeed configures the DeepSpeed engine: add --engine deepspeed")
    if args.compile == "true" and args.engine != "deepspeed":
        raise SpecError("--compile true: the plain PyTorch engine does not compile; add "
                        "--engine deepspeed")
    jobs = [with_engine_options(job, args.zero_stage, args.compile, args.deepspeed)
            for job in jobs]
    if len(jobs) > 1:
        return train_stack(spec, jobs, args)
    job = jobs[0]
    t = job.trial
    print(f"{t.label} ({t.workload}, {t.dataset}): {t.steps} steps, {t.tokens:,} "
          f"{spec.workload_impl.unit}, {t.params['total']:,} parameters, in-process "
          f"({t.micro_batch_size} per micro-batch x {t.grad_accum} accumulated per step), "
          f"{args.engine} engine", flush=True)
    return spec.workload_impl.train_here(job, args.engine, args.profile, args.metrics_json)


def train_stack(spec: ExperimentSpec, jobs: list[Job], args: argparse.Namespace,
                ) -> list[dict[str, float]]:
    """Train ``jobs`` here as one stacked model and print their report; returns each one's
    final metrics.

    Raises:
        SpecError: an engine other than the plain PyTorch one, a profile, or trials that differ
            in more than learning rate and seed (one line).
    """
    if args.engine != "torch" or args.profile or args.metrics_json:
        raise SpecError("--trial with several trials stacks them on the plain PyTorch engine: "
                        "drop --engine deepspeed, --profile and --metrics-json")
    t = jobs[0].trial
    other = next((j.trial for j in jobs if stack_key(j.trial) != stack_key(t)), None)
    if other is not None:
        raise SpecError(f"--trial: {other.label} ({other.trial_id}) differs from {t.label} "
                        f"({t.trial_id}) in more than lr and seed: they cannot share a stack")
    print(f"{len(jobs)} trials of {t.variant}@{t.size} ({t.workload}, {t.dataset}) as one "
          f"stack: {t.steps} steps, {t.tokens:,} {spec.workload_impl.unit} each, "
          f"{t.params['total']:,} parameters each, in-process", flush=True)
    return spec.workload_impl.train_stack_here(jobs)
