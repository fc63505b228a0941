"""The one train loop of every workload: a workload supplies its model, batches, loss and
evaluation (a ``Task``); the ``Trainer`` does the rest, the same in a Ray Train worker
(``RaySession``) and in this process (``LocalSession``).

Per optimizer step: ``grad_accum`` micro-batches, each forward, backward and engine step (the
engine steps the optimizer, clips and schedules on the last one); ``loss`` (the mean over the
global batch), ``lr`` (the one this step used) and ``<unit>_seen``. Every ``log_interval``
steps: ``<unit>_per_s``, ``flops_per_s`` (all workers; the task's analytic model FLOPs) and
``mfu`` (over the workers' peak, ``Session.peak_flops``), and a log line. Every
``eval_interval`` steps: the validation metrics and a checkpoint, from which a resubmitted
trial resumes at the same step with the same data. At the end: the validation and test
metrics, ``train_wall_s``, ``train_mfu`` and ``peak_memory_mib`` (``Session.efficiency``), the
model kept (``Task.keep``) and the metrics sent (``Session.close``), then a last checkpoint
carrying the clock's phases. A compiled
engine's first step, which compiles the model, is the clock's ``compile`` phase and counts in
neither throughput nor ``train_mfu``.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from workloads.core.trial import Job
from workloads.runtime.engine import Engine
from workloads.runtime.optim import build_optimizer, build_scheduler
from workloads.runtime.session import Backend, Session

UNIT_ABBREVIATIONS = {"tokens": "tok", "examples": "ex"}  # for the log line's rate


class Task(ABC):
    """What a workload supplies to the ``Trainer`` for one trial on one worker.

    ``backend``: how the replicas keep in step (``deepspeed`` or ``ddp``); ``unit``: what the
    trial's budget counts (``tokens``, ``examples``); ``units_per_step``: of one optimizer step,
    all workers together; ``flops_per_unit``: the model's analytic training FLOPs per unit
    (``flops_per_token`` and its kin); ``describe``: the model in a few words, and
    ``headline``: the metrics of the last log line (validation's and test's).
    """

    backend: Backend
    unit: str
    units_per_step: int
    flops_per_unit: float
    describe: str
    headline: tuple[str, ...]

    @abstractmethod
    def build_model(self) -> nn.Module:
        """The model to train (called once, right after the trial's seed is set)."""

    @abstractmethod
    def batches(self, skip: int) -> Iterator[Any]:
        """This worker's micro-batches in training order, after the first ``skip`` of them
        (a resumed trial sees the batches it would have seen uninterrupted)."""

    @abstractmethod
    def loss(self, engine: Engine, batch: Any) -> torch.Tensor:
        """The mean loss of one micro-batch, its forward pass included (a scalar)."""

    @abstractmethod
    def evaluate(self, engine: Engine, split: str) -> dict[str, float]:
        """Metrics of the model on ``split`` (``validation``: at every evaluation, ``test``: at
        the end). A collective: every rank calls it."""

    def diagnostics(self, engine: Engine) -> dict[str, float]:
        """More metrics of the model at every validation, logged but not reported with the
        checkpoint. A collective. Default: none."""
        return {}

    def vmappable(self, model: nn.Module) -> nn.Module:
        """``model`` (an empty copy of the one ``build_model`` makes) in a form whose forward
        ``torch.func.vmap`` batches over stacked parameters (``runtime.stacked``), the same
        numbers up to rounding. Default: as it is."""
        return model

    def keep(self, engine: Engine) -> None:  # noqa: B027 (optional: most tasks keep nothing)
        """After training: keep the trained model (every rank calls it). Default: nothing."""


class Trainer:
    """Trains ``job``'s trial to its budget in ``session`` with ``task``; ``fit`` returns the
    final validation and test metrics with ``train_wall_s``, ``train_mfu`` and
    ``peak_memory_mib``."""

    def __init__(self, job: Job, session: Session, task: Task) -> None:
        self.job, self.session, self.task = job, session, task

    def fit(self) -> dict[str, float]:
        trial, session, task = self.job.trial, self.session, self.task
        t, world = trial.training, session.world_size
        torch.manual_seed(trial.seed)
        model = task.build_model()
        optimizer = build_optimizer(model, trial.optimizer, lr=trial.lr)  # the trial's LR
        scheduler = build_scheduler(optimizer, trial.schedule, trial.steps)
        engine = session.engine(model, optimizer, scheduler, task.backend)
        start_step = session.restore(engine)
        batches = task.batches(skip=start_step * trial.grad_accum)
        total_steps, device, clock = trial.steps, engine.device, session.clock
        rate = f"{UNIT_ABBREVIATIONS.get(task.unit, task.unit)}/s"

        def validate(step: int) -> dict[str, float]:
            with clock.phase("eval"):
                out = task.evaluate(engine, "validation")
                session.log(out, step)
                extra = task.diagnostics(engine)
                if extra:
                    session.log(extra, step)
                session.flush()
            return out

        session.info("[train] %s: %d steps x %d %s, %d worker(s), %s, %s", task.describe,
                     total_steps, task.units_per_step, task.unit, world, engine.name,
                     session.precision)
        peak_flops = session.peak_flops(device) * world  # all workers
        start = interval_start = time.perf_counter()
        interval_from = start_step  # throughput: over the steps after this one
        compiling, timed_steps = engine.compiled, 0
        for step in range(start_step + 1, total_steps + 1):
            clock.first_step()
            with clock.phase("compile" if compiling else "train"):
                lr = engine.lr()  # the LR this optimizer step uses
                loss_sum = torch.zeros((), device=device)
                for _ in range(trial.grad_accum):
                    loss = task.loss(engine, next(batches))
                    engine.backward(loss)
                    engine.step()
                    loss_sum += loss.detach()
                session.all_reduce(loss_sum)
                metrics = {"loss": loss_sum.item() / (trial.grad_accum * world), "lr": lr,
                           f"{task.unit}_seen": step * task.units_per_step}
                if step % t.log_interval == 0 or step == total_steps:
                    now = time.perf_counter()
                    per_s = (step - interval_from) * task.units_per_step / (now - interval_start)
                    metrics[f"{task.unit}_per_s"] = per_s
                    metrics["flops_per_s"] = per_s * task.flops_per_unit  # achieved
                    metrics["mfu"] = metrics["flops_per_s"] / peak_flops
                    interval_start, interval_from = now, step
                    eta = (now - start) / (step - start_step) * (total_steps - step)
                    session.info("[train] step %d/%d | loss %.4f | lr %.2e | %s %s | MFU %.1f%% "
                                 "| eta %.0fs", step, total_steps, metrics["loss"], lr,
                                 f"{per_s:,.0f}", rate, 100 * metrics["mfu"], eta)
                session.log(metrics, step)
                if f"{task.unit}_per_s" in metrics:
                    session.flush()
            if compiling:  # throughput from the next step on
                compiling, interval_start, interval_from = False, time.perf_counter(), step
            else:
                timed_steps += 1
            if step % t.eval_interval == 0 and step < total_steps:
                paused = time.perf_counter()
                scores = validate(step)
                with clock.phase("checkpoint"):
                    session.checkpoint(engine, step, scores)
                interval_start += time.perf_counter() - paused  # throughput: training alone

        final = validate(total_steps)
        with clock.phase("eval"):
            test = task.evaluate(engine, "test")
        test.update({"train_wall_s": time.perf_counter() - start, **session.efficiency(
            task.flops_per_unit * task.units_per_step * timed_steps, device)})
        session.log(test, total_steps)
        session.flush()
        done = {**final, **test}
        session.info("[train] done: %s in %.0fs", ", ".join(
            f"{k} {done[k]:.4f}" for k in task.headline), test["train_wall_s"])
        phases = clock.metrics()  # so far; they go to the driver with the last report
        task.keep(engine)  # before the last checkpoint: a trial with one has kept its model
        session.close()  # and has sent its metrics (an outage is waited out here)
        session.checkpoint(engine, total_steps, {**final, **test, **phases})
        return {**final, **test}
