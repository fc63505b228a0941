"""Run one trial in this process: no Ray, no MLflow server.

    python -m workloads.train --preset nano --steps 50            # a language model, Shakespeare
    python -m workloads.train --spec SPEC.yaml --trial 3          # trial 3 of a spec's plan
    python -m workloads.train --spec SPEC.yaml --trial 3f2a9c1b   # ... or by its trial id
    python -m workloads.train --spec SPEC.yaml --trial 3 --metrics-json m.json  # every metric
    python -m workloads.train --preset llama-134m --engine deepspeed --zero-stage 1
    python -m workloads.train --preset micro --engine deepspeed --profile 20  # a step's kernels

``run_in_ray`` is what every Ray Train worker runs; ``run_in_process`` runs the same train loop
(the workload's own ``Workload.train``) in a ``LocalSession``: a plain PyTorch engine on this
machine's GPU or CPU, or with ``--engine deepspeed`` DeepSpeed's engine on a process group of
this one process (``LocalDeepSpeedSession``), as a one-worker Ray trial runs it: a GPU machine
with torch and DeepSpeed but no Ray can run a trial. ``--zero-stage`` and ``--compile`` replace
the trial's ``training.zero_stage`` and ``training.compile``. The command prints the loss as it
trains, then the engine, the validation and test metrics, the train metrics (``train_mfu``, the
last ``tokens_per_s``, ``peak_memory_mib``) and the clock's phases. ``--spec`` plans the spec
exactly as ``python -m orchestrator plan`` does (``#`` is the plan's row, from 0).
``--metrics-json`` also writes every logged metric (``{"trial", "final", "history": {name:
{step: value}}}``) to a JSON file, written whole or not at all. ``--profile N`` profiles train
steps 4 and 5 (``timing.ProfiledClock``): the whole step, the optimizer's and the engine's
work included, where ``workloads.bench`` times the forward and backward alone; it prints their
wall and busy time per step and the N longest GPU kernels (torch operators on a CPU), and
adds ``profile`` to the JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import sys

import torch
from tabulate import tabulate

from workloads.atomic import atomic_path
from workloads.base import Job, Trial
from workloads.config import ResourcesConfig, TrainingConfig
from workloads.data import CorpusConfig
from workloads.models import PRESETS, ModelConfig
from workloads.registry import get_workload
from workloads.session import (
    LocalDeepSpeedSession,
    LocalSession,
    RaySession,
    one_rank_process_group,
)
from workloads.settings import Paths
from workloads.timing import ProfiledClock, format_kernels


def run_in_ray(job: Job) -> None:
    """Ray Train's ``train_loop_per_worker``: the job's workload trains it in a ``RaySession``.

    Pass it as ``functools.partial(run_in_ray, job)``: the typed job is the only thing that
    crosses to the workers.
    """
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    session = RaySession(job)
    get_workload(job.trial.workload).train(job, session)
    session.close()


def run_in_process(job: Job, engine: str = "torch", profile_top: int = 0,
                   ) -> tuple[dict[str, float], LocalSession]:
    """Train ``job`` in this process with a plain PyTorch ``engine`` (``LocalSession``) or
    DeepSpeed's (``deepspeed``: ``LocalDeepSpeedSession``, inside a ``one_rank_process_group``
    that is gone when this returns); returns its final metrics and the session (whose
    ``history`` has every logged metric, ``made`` the engine). With ``profile_top`` the
    session's clock is a ``ProfiledClock`` keeping that many kernels of two train steps."""
    deepspeed = engine == "deepspeed"
    with one_rank_process_group() if deepspeed else contextlib.nullcontext():
        session = (LocalDeepSpeedSession if deepspeed else LocalSession)(job)
        if profile_top:
            session.clock = ProfiledClock(session.clock.started_at, profile_top,
                                          cuda=torch.cuda.is_available())
        return get_workload(job.trial.workload).train(job, session), session


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m workloads.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--preset", choices=sorted(PRESETS), help="a model preset (llama-* and "
                      "the CPU sizes are Llama, cem-* the paper's best CEM; --attention/--mlp "
                      "override)")
    what.add_argument("--spec", help="an experiment spec; pick the trial with --trial")
    parser.add_argument("--trial", help="with --spec: the plan's row number or a trial id")
    parser.add_argument("--steps", type=int, help="optimizer steps (default: the trial's "
                        "budget with --spec, 100 with --preset)")
    parser.add_argument("--attention", choices=["llama", "cem"],
                        help="the sublayer kind (default: the preset's)")
    parser.add_argument("--mlp", choices=["llama", "cem"], help="(default: the preset's)")
    parser.add_argument("--lr", type=float, default=0.002, help="peak learning rate (--preset)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    parser.add_argument("--corpus", default=None,
                        help="a glob of text files (default: the embedded Shakespeare)")
    parser.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="fp32")
    parser.add_argument("--engine", choices=["torch", "deepspeed"], default="torch",
                        help="plain PyTorch, or DeepSpeed ZeRO on a one-process group (what a "
                        "Ray worker runs)")
    parser.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3],
                        help="DeepSpeed's ZeRO stage (default: the trial's)")
    parser.add_argument("--compile", choices=["auto", "true", "false"],
                        help="torch.compile the model and loss; auto: on a GPU at ZeRO 0-2 "
                        "(default: the trial's)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="profile train steps 4 and 5 and print their N longest GPU kernels "
                        "(torch operators on a CPU), their wall and busy time per step")
    parser.add_argument("--metrics-json", metavar="PATH",
                        help="also write every logged metric (and the final ones) to PATH")
    return parser


def preset_config(args: argparse.Namespace, vocab_size: int) -> ModelConfig:
    """``args.preset`` at ``vocab_size`` (the prepared corpus's), its sublayer kinds replaced
    only where ``--attention``/``--mlp`` name one: ``--preset cem-134m`` is the paper's best
    CEM configuration, not Llama with its recursion and preconditioner fields."""
    kinds = {k: v for k, v in (("attention", args.attention), ("mlp", args.mlp)) if v}
    return ModelConfig.from_preset(args.preset, vocab_size=vocab_size, **kinds)


def preset_trial(args: argparse.Namespace, data_dir: str) -> Job:
    """A language-model trial of ``args.preset`` on Shakespeare (or ``args.corpus``), with the
    preset's vocabulary, ``args.steps`` steps of ``args.batch_size`` sequences."""
    workload = get_workload("language_model")
    preset = PRESETS[args.preset]
    corpus = CorpusConfig(vocab_size=preset.vocab_size,
                          **({"source": "text_files", "paths": args.corpus} if args.corpus
                             else {}))
    prepared = workload.prepare(corpus, data_dir)
    model = preset_config(args, prepared.data.vocab_size)
    steps = args.steps or 100
    training = TrainingConfig(tokens=steps * args.batch_size * model.context_length,
                              batch_size=args.batch_size, micro_batch_size=args.batch_size,
                              eval_interval=max(steps // 4, 1), eval_sequences=64,
                              precision=args.precision)
    trial = Trial(trial_id="local", workload=workload.name, dataset=corpus.source,
                  variant=f"{model.attention}-{model.mlp}", size=args.preset, lr=args.lr,
                  seed=args.seed, model=model, config=corpus, training=training,
                  resources=ResourcesConfig(num_workers=1),
                  budget=workload.budget(corpus, training, args.preset, model),
                  micro_batch_size=args.batch_size, grad_accum=1)
    return Job(trial, prepared.data)


def spec_trial(args: argparse.Namespace, data_dir: str) -> Job:
    """Trial ``args.trial`` (row or id) of the spec's plan, with its prepared data, on one
    worker: ``micro_batch_size x grad_accum`` is the spec's whole ``batch_size``, whatever
    ``resources.num_workers`` the plan has (its id stays the plan's).

    Raises:
        SystemExit: an invalid spec, or no such trial (one line naming it).
    """
    # The one place workloads reaches into the orchestrator: reading and planning a spec is
    # the orchestrator's job, and this command's purpose is to run one of its trials.
    from orchestrator.plan import batch_geometry, plan
    from orchestrator.spec import SpecError, load_spec

    try:
        spec = load_spec(args.spec)
    except SpecError as e:
        sys.exit(f"error: {e}")
    workload = get_workload(spec.workload)
    trials = plan(spec)  # first without data: a wrong row fails before any download
    wrong = (f"error: --trial {args.trial!r}: not a row (0..{len(trials) - 1}) or trial id "
             f"of {args.spec}")
    maybe_id = len(args.trial) == len(trials[0].trial_id)  # an id may be digits only
    row = not maybe_id and args.trial.isdigit() and int(args.trial) < len(trials)
    if not (row or maybe_id):
        sys.exit(wrong)
    prepared = workload.prepare(spec.workload_config, data_dir)
    planned = plan(spec, prepared.data)  # ids as `run` has them (they cover the corpus)
    index = int(args.trial) if row else next(
        (i for i, t in enumerate(planned) if args.trial in (t.trial_id, trials[i].trial_id)),
        None)
    if index is None:
        sys.exit(wrong)
    # This process is the trial's only worker: it takes the whole global batch per step, as
    # the planned workers do together (the same micro-batch size, their share accumulated).
    trial = planned[index]
    one = trial.resources.model_copy(update={"num_workers": 1})
    micro, accum = batch_geometry(trial.training, one, workload.micro_batches)
    return Job(dataclasses.replace(trial, resources=one, micro_batch_size=micro,
                                   grad_accum=accum), prepared.data)


def with_steps(job: Job, steps: int) -> Job:
    """``job`` cut (or extended) to ``steps`` optimizer steps."""
    trial = job.trial
    units = trial.budget.units * steps // trial.steps
    budget = dataclasses.replace(trial.budget, steps=steps, units=units,
                                 flops=trial.budget.flops * steps / trial.steps)
    return dataclasses.replace(job, trial=dataclasses.replace(trial, budget=budget))


def with_engine_options(job: Job, zero_stage: int | None, compiles: str | None) -> Job:
    """``job`` with ``training.zero_stage`` and ``training.compile`` replaced where given
    (``compiles``: ``auto``, ``true`` or ``false``); neither is part of a trial's identity."""
    update = {**({"zero_stage": zero_stage} if zero_stage is not None else {}),
              **({"compile": {"true": True, "false": False}.get(compiles, compiles)}
                 if compiles is not None else {})}
    if not update:
        return job
    training = TrainingConfig.model_validate({**job.trial.training.model_dump(), **update})
    return dataclasses.replace(job, trial=dataclasses.replace(job.trial, training=training))


def report(final: dict[str, float], session: LocalSession) -> list[list[str]]:
    """The rows of the final table: the engine, ``final``'s metrics, the last logged
    ``tokens_per_s`` and the seconds of each of the clock's phases."""
    def fmt(v: float | int) -> str:
        return f"{v:,.4f}" if isinstance(v, float) else f"{v:,}"

    rows = [["engine", session.made.name if session.made else "-"]]
    rows += [[k, fmt(v)] for k, v in final.items()]
    tokens_per_s = session.history.get("tokens_per_s")
    if tokens_per_s:
        rows.append(["tokens_per_s (last logged)", fmt(tokens_per_s[max(tokens_per_s)])])
    rows += [[k, fmt(v)] for k, v in session.clock.metrics().items()]
    return rows


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.spec and args.trial is None:
        _parser().error("--spec needs --trial (a row of `python -m orchestrator plan SPEC`)")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    data_dir = str(Paths().data_dir)
    job = spec_trial(args, data_dir) if args.spec else preset_trial(args, data_dir)
    if args.spec and args.steps:
        job = with_steps(job, args.steps)
    job = with_engine_options(job, args.zero_stage, args.compile)
    t = job.trial
    print(f"{t.label} ({t.workload}, {t.dataset}): {t.steps} steps, {t.tokens:,} "
          f"{get_workload(t.workload).unit}, {t.params['total']:,} parameters, in-process "
          f"({t.micro_batch_size} per micro-batch x {t.grad_accum} accumulated per step), "
          f"{args.engine} engine", flush=True)
    final, session = run_in_process(job, args.engine, args.profile)
    clock = session.clock
    profile = getattr(clock, "profile", None)
    if args.metrics_json:
        with atomic_path(args.metrics_json) as tmp:
            tmp.write_text(json.dumps({"trial": {"id": t.trial_id, "label": t.label},
                                       "final": final, "history": session.history,
                                       **({"profile": profile} if profile else {})}))
    print(tabulate(report(final, session), headers=["metric", "value"],
                   colalign=("left", "right"), disable_numparse=True))
    last = clock.skip + clock.steps if args.profile else 0  # the last profiled train step
    if profile:
        print(f"\ntrain steps {clock.skip + 1}-{last}, profiled: "
              f"{profile['wall_ms_per_step']:,.1f} ms a step, {profile['busy_ms_per_step']:,.1f}"
              f" ms of it in {'GPU kernels' if clock.cuda else 'torch operators'}; the "
              f"{args.profile} longest:\n{format_kernels(profile['kernels'])}")
    elif args.profile:
        print(f"\nno profile: it needs {last} train steps ({last + 1} where the first compiles)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
