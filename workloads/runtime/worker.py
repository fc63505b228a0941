"""Where a trial's train loop runs: in a Ray Train worker, or in this process.

``run_in_ray`` is what every Ray Train worker of a pack of trials runs; ``run_in_process``
runs the same train loop (the workload's ``train``) in a ``LocalSession``: a plain PyTorch
engine on this machine's GPU or CPU, or DeepSpeed's engine on a process group of this one process
(``LocalDeepSpeedSession``), as a one-worker Ray trial runs it, so a GPU machine with torch and
DeepSpeed but no Ray can run a trial. ``train_here`` does that and prints the report: the
engine, the validation and test metrics, the train metrics (``train_mfu``, the last
``tokens_per_s``, ``peak_memory_mib``), the clock's phases and, with a profile, the longest
kernels of two whole train steps (``timing.ProfiledClock``: the optimizer's and the engine's
work included, where ``workloads.lm.step_bench`` times the forward and backward alone).
``TrainedWorkload`` gives a workload both, from its ``train``. ``run_stacked_in_process``
trains several same-shaped trials as one stacked model (``runtime.stacked``), each in its own
``LocalSession``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import time
from abc import abstractmethod

import torch
from tabulate import tabulate

from workloads.core.atomic import atomic_path
from workloads.core.trial import Job
from workloads.core.workload import Workload
from workloads.runtime.session import (
    LocalDeepSpeedSession,
    LocalSession,
    RaySession,
    Session,
    one_rank_process_group,
)
from workloads.runtime.stacked import StackedTrainer
from workloads.runtime.timing import ProfiledClock, format_kernels
from workloads.runtime.trainer import Task, Trainer


class TrainedWorkload(Workload):
    """A workload trained by the one ``Trainer`` in this runtime's sessions, under Ray Train
    (``train_loop_per_worker``) or in this process (``train_here``): it supplies its ``task``
    (model, batches, loss, evaluation)."""

    @abstractmethod
    def task(self, job: Job, session: Session) -> Task:
        """What the ``Trainer`` needs of ``job``'s trial on the worker of ``session``."""

    def train(self, job: Job, session: Session) -> dict[str, float]:
        """Train ``job.trial`` to its budget on one worker, reporting through ``session``;
        returns the final metrics (``metric`` among them)."""
        return Trainer(job, session, self.task(job, session)).fit()

    def train_stack(self, jobs: list[Job], sessions: list[Session]) -> list[dict[str, float]]:
        """Train ``jobs`` as one stacked model (``StackedTrainer``), each in its session;
        returns each one's final metrics, in order."""
        tasks = [self.task(job, session) for job, session in zip(jobs, sessions)]
        return StackedTrainer(jobs, sessions, tasks).fit()

    def train_loop_per_worker(self, jobs: list[Job], stacks: tuple[int, ...] = ()) -> None:
        run_in_ray(jobs, self, stacks)

    def train_here(self, job: Job, engine: str = "torch", profile_top: int = 0,
                   metrics_json: str | None = None) -> dict[str, float]:
        return train_here(job, self, engine, profile_top, metrics_json)

    def train_stack_here(self, jobs: list[Job]) -> list[dict[str, float]]:
        return train_stack_here(jobs, self)


def run_in_ray(jobs: list[Job], workload: TrainedWorkload, stacks: tuple[int, ...] = (),
               ) -> None:
    """Ray Train's ``train_loop_per_worker`` of a pack of same-shaped trials: ``workload``
    trains each of ``jobs`` in turn on this worker group, each in a ``RaySession`` of its own,
    so processes, process group, imports and data stay warm between them; ``stacks``: the
    sizes of the consecutive runs of ``jobs`` that train at once as one stacked model
    (``workload.train_stack``; empty: each alone).

    Ray Train gets it bound to the jobs (``functools.partial(workload.train_loop_per_worker,
    jobs, stacks)``): the typed jobs and the workload are all that cross to the workers. After a
    restart of the worker group, each trial resumes from its own newest checkpoint; one already
    trained is reported again, not trained (``RaySession.report_if_trained``). The first
    trials' clocks start when the driver handed the pack over, each next one's when the ones
    before ended.
    """
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    position = 0
    for size in stacks or (1,) * len(jobs):
        group = jobs[position:position + size]
        if position:
            now = time.time()
            group = [dataclasses.replace(job, submitted_at=now) for job in group]
        # the members of a stack checkpoint alike: all at its first position (pack.keep_score)
        sessions = [RaySession(job, position) for job in group]
        position += size
        todo = [(job, session) for job, session in zip(group, sessions)
                if not session.report_if_trained()]
        for _, session in todo:
            session.start()
        if len(todo) == 1:
            workload.train(*todo[0])
        elif todo:
            workload.train_stack([job for job, _ in todo], [session for _, session in todo])
        del sessions, todo
        gc.collect()  # the trials' engines, models and optimizer states, before the next ones'
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def run_in_process(job: Job, workload: TrainedWorkload, engine: str = "torch",
                   profile_top: int = 0) -> tuple[dict[str, float], LocalSession]:
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
        return workload.train(job, session), session


def run_stacked_in_process(jobs: list[Job], workload: TrainedWorkload,
                           ) -> list[tuple[dict[str, float], LocalSession]]:
    """Train ``jobs`` (one shape, ``stacked.stack_key``) as one stack in this process, each in
    a ``LocalSession`` of its own; returns each one's final metrics and session, in order.

    Raises:
        ValueError: the jobs cannot share a stack (``StackedTrainer``).
    """
    sessions = [LocalSession(job) for job in jobs]
    return list(zip(workload.train_stack(jobs, sessions), sessions))


def train_stack_here(jobs: list[Job], workload: TrainedWorkload) -> list[dict[str, float]]:
    """``run_stacked_in_process``, then print one column of final metrics per member
    (``report``'s rows). Returns each member's final metrics, in order."""
    results = run_stacked_in_process(jobs, workload)
    tables = [dict(report(final, session)) for final, session in results]
    names = list(dict.fromkeys(name for table in tables for name in table))
    print(tabulate([[name, *(table.get(name, "-") for table in tables)] for name in names],
                   headers=["metric", *(job.trial.label for job in jobs)],
                   colalign=("left", *("right",) * len(jobs)), disable_numparse=True))
    return [final for final, _ in results]


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


def train_here(job: Job, workload: TrainedWorkload, engine: str = "torch", profile_top: int = 0,
               metrics_json: str | None = None) -> dict[str, float]:
    """``run_in_process``, then print ``report`` and the profile; with ``metrics_json``, write
    every logged metric (``{"trial", "final", "history": {name: {step: value}}}``, and
    ``profile``) to that file, whole or not at all. Returns the final metrics."""
    t = job.trial
    final, session = run_in_process(job, workload, engine, profile_top)
    clock = session.clock
    profile = getattr(clock, "profile", None)
    if metrics_json:
        with atomic_path(metrics_json) as tmp:
            tmp.write_text(json.dumps({"trial": {"id": t.trial_id, "label": t.label},
                                       "final": final, "history": session.history,
                                       **({"profile": profile} if profile else {})}))
    print(tabulate(report(final, session), headers=["metric", "value"],
                   colalign=("left", "right"), disable_numparse=True))
    last = clock.skip + clock.steps if profile_top else 0  # the last profiled train step
    if profile:
        print(f"\ntrain steps {clock.skip + 1}-{last}, profiled: "
              f"{profile['wall_ms_per_step']:,.1f} ms a step, {profile['busy_ms_per_step']:,.1f}"
              f" ms of it in {'GPU kernels' if clock.cuda else 'torch operators'}; the "
              f"{profile_top} longest:\n{format_kernels(profile['kernels'])}")
    elif profile_top:
        print(f"\nno profile: it needs {last} train steps ({last + 1} where the first compiles)")
    return final
