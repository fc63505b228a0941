"""Stacked trials: K trials of one shape trained as one batched model in this process
(``torch.func.stack_module_state`` + ``functional_call`` + ``vmap``), so that K small matrix
products become one K-batched product and the per-operation overhead is paid once for K.

Members differ in learning rate and seed only (``stack_key``). Each keeps what it has when it
trains alone (``Trainer``): its initial weights (its seed, set right before its model is built)
and data order (its task's ``batches``), its LR schedule (its peak LR x ``lr_factor``),
gradient clipping at ``optimizer.grad_clip`` on its own global norm, torch's AdamW update on its
own state (``StackedAdamW``), its metrics (its session's ``log``), its evaluation (its task's
``evaluate`` on its own model) and its kept model. The loss the backward pass starts from is
the sum of the members' losses, which couples nothing: a member's gradient depends on its own
parameters and batches alone. A member whose loss turns NaN or infinite has diverged: its
weights stay at its last finite step, it logs ``diverged`` (1.0) at that step, is not evaluated,
and the others go on.

Where it applies: the plain torch engine on one worker in fp32 or bf16
(autocast, as ``TorchEngine``), uncompiled. Attention runs its math kernel written out
(``Task.vmappable``), which ``vmap`` batches; DeepSpeed ZeRO and compiled models train alone.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, stack_module_state, vmap

from workloads.core.config import OptimizerConfig
from workloads.core.trial import Job, stack_key
from workloads.runtime.engine import TorchEngine
from workloads.runtime.optim import (
    build_optimizer,
    build_scheduler,
    decayed_parameters,
    lr_factor,
)
from workloads.runtime.session import Session
from workloads.runtime.trainer import UNIT_ABBREVIATIONS, Task


class StackedAdamW:
    """``torch.optim.AdamW`` (its single-tensor update, paper Table 2's betas, eps and decay)
    over stacked parameters ``{name: (K, ...)}``, member k at its own learning rate
    ``lrs[k] * lr_factor(step)``; weight decay on the parameters named in ``decayed``.

    ``step(alive)`` updates the members where ``alive`` (K,) bool is true and leaves the others
    as they are.
    """

    def __init__(self, params: dict[str, torch.Tensor], decayed: set[str], lrs: Sequence[float],
                 cfg: OptimizerConfig) -> None:
        self.params, self.decayed, self.cfg = params, decayed, cfg
        self.lrs = torch.tensor(lrs, dtype=torch.float64)  # (K,)
        self.exp_avg = {n: torch.zeros_like(p) for n, p in params.items()}
        self.exp_avg_sq = {n: torch.zeros_like(p) for n, p in params.items()}
        self.steps = 0

    @torch.no_grad()
    def step(self, factor: float, alive: torch.Tensor) -> None:
        """One update at learning rates ``lrs x factor`` of the members where ``alive``."""
        cfg, self.steps = self.cfg, self.steps + 1
        lr = self.lrs * factor  # (K,) float64: torch keeps the LR a Python float
        bias1, bias2 = 1 - cfg.beta1 ** self.steps, 1 - cfg.beta2 ** self.steps
        for name, p in self.params.items():
            g, m, v = p.grad, self.exp_avg[name], self.exp_avg_sq[name]
            shape = (-1,) + (1,) * (p.dim() - 1)
            keep = alive.view(shape)
            wd = cfg.weight_decay if name in self.decayed else 0.0
            new_p = p * (1 - lr * wd).to(p.dtype).view(shape)
            new_m = m.lerp(g, 1 - cfg.beta1)
            new_v = (v * cfg.beta2).addcmul_(g, g, value=1 - cfg.beta2)
            denom = (new_v.sqrt() / math.sqrt(bias2)).add_(cfg.eps)
            new_p -= (lr / bias1).to(p.dtype).view(shape) * (new_m / denom)
            p.copy_(torch.where(keep, new_p, p))
            m.copy_(torch.where(keep, new_m, m))
            v.copy_(torch.where(keep, new_v, v))

    @torch.no_grad()
    def export(self, k: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Put member ``k``'s moments and step count into ``optimizer`` (a ``torch.optim.AdamW``
        over ``model``'s parameters), as it holds them after as many steps alone: what its
        checkpoint saves."""
        step = torch.tensor(float(self.steps), dtype=torch.float32)
        for name, p in model.named_parameters():
            optimizer.state[p] = {"step": step.clone(),
                                  "exp_avg": self.exp_avg[name][k].clone(),
                                  "exp_avg_sq": self.exp_avg_sq[name][k].clone()}

    @torch.no_grad()
    def load(self, k: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Take member ``k``'s moments and step count from ``optimizer`` (``export``'s form,
        as a checkpoint restored them); a parameter it holds no state of starts at zero."""
        for name, p in model.named_parameters():
            state = optimizer.state.get(p)
            if state:
                self.exp_avg[name][k].copy_(state["exp_avg"])
                self.exp_avg_sq[name][k].copy_(state["exp_avg_sq"])
                self.steps = int(state["step"])


def clip_per_member(grads: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale each member's gradients (tensors (K, ...)) by ``max_norm / (its global norm +
    1e-6)``, at most 1, as ``torch.nn.utils.clip_grad_norm_`` does for one model; returns the
    norms before clipping, (K,)."""
    per_tensor = torch.stack([g.flatten(1).norm(dim=1) for g in grads])  # (n_tensors, K)
    norms = per_tensor.norm(dim=0)  # (K,)
    coef = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.view((-1,) + (1,) * (g.dim() - 1)))
    return norms


class _Member:
    """One member's model as ``Task.loss`` sees an engine: ``engine(x)`` runs the stack's
    functional model on this member's parameters (batched tensors under ``vmap``)."""

    compiled = False

    def __init__(self, base: nn.Module, params: dict, buffers: dict, device: torch.device,
                 bf16: bool) -> None:
        self.base, self.state, self.device, self.bf16 = base, (params, buffers), device, bf16

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device.type, torch.bfloat16, enabled=self.bf16):
            return functional_call(self.base, self.state, inputs)


Loss = Callable[[Any, Any], torch.Tensor]  # Task.loss: (engine, micro-batch) -> scalar


class Stack:
    """``models`` (K of one architecture, on ``device``) stacked: parameters and buffers
    ``{name: (K, ...)}``, a ``StackedAdamW`` at peak learning rates ``lrs`` (K), and ``step``,
    one optimizer step of all members. ``loss(engine, batch)`` is one member's mean loss of a
    micro-batch (``Task.loss``); ``vmappable`` turns an empty copy of the model into the form
    ``vmap`` batches (``Task.vmappable``)."""

    def __init__(self, models: Sequence[nn.Module], lrs: Sequence[float], cfg: OptimizerConfig,
                 loss: Loss, vmappable: Callable[[nn.Module], nn.Module],
                 device: torch.device, bf16: bool) -> None:
        self.params, self.buffers = stack_module_state(list(models))  # params require grad
        base = vmappable(copy.deepcopy(models[0]).to("meta"))
        decayed_ids = {id(p) for p in decayed_parameters(models[0])}
        decayed = {n for n, p in models[0].named_parameters() if id(p) in decayed_ids}
        self.optimizer = StackedAdamW(self.params, decayed, lrs, cfg)
        self.grad_clip = cfg.grad_clip

        def member_loss(p: dict, b: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return loss(_Member(base, p, b, device, bf16), (x, y))

        self._losses = vmap(member_loss)

    def step(self, micro_batches: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]],
             factor: float, alive: torch.Tensor) -> torch.Tensor:
        """Forward and backward of every micro-batch (each a member's ``(x, y)``, K of them,
        stacked into (K, B, T)), the gradients averaged over them, clipped per member, and the
        update at ``factor`` of the peak rates for the members where ``alive`` (K,) and whose
        loss is finite. Returns each member's mean loss (K,)."""
        loss_sum = None
        for pairs in micro_batches:
            x = torch.stack([xy[0] for xy in pairs])  # (K, B, T)
            y = torch.stack([xy[1] for xy in pairs])
            losses = self._losses(self.params, self.buffers, x, y)  # (K,)
            (losses.sum() / len(micro_batches)).backward()
            loss_sum = losses.detach() if loss_sum is None else loss_sum + losses.detach()
        loss = loss_sum / len(micro_batches)
        clip_per_member([p.grad for p in self.params.values()], self.grad_clip)
        self.optimizer.step(factor, alive & torch.isfinite(loss))
        for p in self.params.values():
            p.grad = None
        return loss

    @torch.no_grad()
    def write_to(self, models: Sequence[nn.Module]) -> None:
        """Copy member k's parameters into ``models[k]``."""
        for k, model in enumerate(models):
            for name, p in model.named_parameters():
                p.copy_(self.params[name][k])


def advance(scheduler: torch.optim.lr_scheduler.LRScheduler, step: int) -> None:
    """Step ``scheduler`` until it has taken ``step`` steps, as it has after ``step`` optimizer
    steps alone (the stack's optimizer steps the members itself: torch's warning that the
    scheduler steps before its optimizer does not apply)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler\.step\(\)` before "
                                r"`optimizer\.step\(\)`", UserWarning)
        while scheduler.last_epoch < step:
            scheduler.step()


class StackedTrainer:
    """Trains the trials of ``jobs`` (K of them, one shape: ``stack_key``) as one stacked
    model, member k in ``sessions[k]`` with ``tasks[k]``; ``fit`` returns each member's final
    metrics, in order (validation and test, ``train_wall_s``, ``train_mfu``,
    ``peak_memory_mib``), or, for a member that diverged, its ``Task.headline`` metrics NaN
    with ``diverged`` (1.0) and ``diverged_step``.

    Each member has the plain torch engine its session builds (``TorchEngine``: its model,
    torch AdamW and LR scheduler), which evaluates it and which its session checkpoints and
    restores: every ``eval_interval`` steps the stack's state goes to every live member's
    engine (``StackedAdamW.export``, ``advance``) and its session checkpoints it, in the
    format of the same trial alone. A stack restarted (its worker died) resumes from the newest
    step that every member has a good checkpoint of, each member from its own, bit-identical
    to an uninterrupted stack; a member already trained is not in it (``run_stack_in_ray``).

    Raises:
        ValueError: no jobs; members that differ in more than learning rate and seed; a session
            of more than one worker, or one whose engine is not the plain torch one.
    """

    def __init__(self, jobs: Sequence[Job], sessions: Sequence[Session],
                 tasks: Sequence[Task]) -> None:
        if not jobs:
            raise ValueError("a stack needs at least one trial")
        key = stack_key(jobs[0].trial)
        for job in jobs[1:]:
            if stack_key(job.trial) != key:
                raise ValueError(f"trial {job.trial.trial_id} differs from "
                                 f"{jobs[0].trial.trial_id} in more than lr and seed: "
                                 "they cannot share a stack")
        if any(s.world_size != 1 for s in sessions):
            raise ValueError("stacked trials train on one worker")
        self.jobs, self.sessions, self.tasks = list(jobs), list(sessions), list(tasks)

    def _engines(self) -> list[TorchEngine]:
        """Each member's fresh engine: its model (its seed set right before it is built, as
        ``Trainer.fit`` does), AdamW at its learning rate and its LR schedule."""
        engines = []
        for job, session, task in zip(self.jobs, self.sessions, self.tasks):
            trial = job.trial
            torch.manual_seed(trial.seed)
            model = task.build_model()
            optimizer = build_optimizer(model, trial.optimizer, lr=trial.lr)
            engine = session.engine(model, optimizer, build_scheduler(
                optimizer, trial.schedule, trial.steps), "ddp")
            if not isinstance(engine, TorchEngine):
                raise ValueError(f"stacked trials train on the plain torch engine, not "
                                 f"{engine.name}")
            engines.append(engine)
        return engines

    def _restored(self) -> tuple[list[TorchEngine], int]:
        """The members' engines at the newest step that every member has a good checkpoint
        of (0: fresh), and that step."""
        engines = self._engines()
        steps = [s.restore(e) for s, e in zip(self.sessions, engines)]
        while len(set(steps)) > 1:  # a kill between two members' checkpoints
            common = min(steps)
            self.sessions[0].info("[train] the stack's members have checkpoints up to steps "
                                  "%s: all resume from step %d", steps, common)
            engines = self._engines()
            steps = [s.restore(e, at_most=common) if common else 0
                     for s, e in zip(self.sessions, engines)]
        return engines, steps[0]

    def fit(self) -> list[dict[str, float]]:
        jobs, sessions, tasks = self.jobs, self.sessions, self.tasks
        trial, task, session = jobs[0].trial, tasks[0], sessions[0]
        k_members, total_steps, t = len(jobs), trial.steps, trial.training
        engines, start_step = self._restored()
        models = [e.model for e in engines]
        device, bf16 = engines[0].device, session.precision == "bf16"
        stack = Stack(models, [j.trial.lr for j in jobs], trial.optimizer, task.loss,
                      task.vmappable, device, bf16)
        for k, engine in enumerate(engines):
            stack.optimizer.load(k, engine.model, engine.optimizer)
        batches = [member_task.batches(skip=start_step * trial.grad_accum)
                   for member_task in tasks]
        alive = torch.ones(k_members, dtype=torch.bool, device=device)
        diverged_at: dict[int, int] = {}

        def clocks(phase: str) -> contextlib.ExitStack:
            entered = contextlib.ExitStack()
            for s in sessions:
                entered.enter_context(s.clock.phase(phase))
            return entered

        def validate(step: int) -> list[dict[str, float]]:
            stack.write_to(models)
            out = []
            with clocks("eval"):
                for k in range(k_members):
                    if k in diverged_at:
                        out.append({})
                        continue
                    scores = tasks[k].evaluate(engines[k], "validation")
                    sessions[k].log(scores, step)
                    extra = tasks[k].diagnostics(engines[k])
                    if extra:
                        sessions[k].log(extra, step)
                    sessions[k].flush()
                    out.append(scores)
            return out

        def checkpoint(k: int, step: int, metrics: dict[str, float]) -> None:
            stack.optimizer.export(k, engines[k].model, engines[k].optimizer)
            advance(engines[k].scheduler, step)
            sessions[k].checkpoint(engines[k], step, metrics)

        session.info("[train] %s: a stack of %d trials, %d steps x %d %s each, %s, %s",
                     task.describe, k_members, total_steps, task.units_per_step, task.unit,
                     "stacked torch", session.precision)
        peak_flops = session.peak_flops(device)
        rate = f"{UNIT_ABBREVIATIONS.get(task.unit, task.unit)}/s"
        start = interval_start = time.perf_counter()
        interval_from = start_step
        for step in range(start_step + 1, total_steps + 1):
            for s in sessions:
                s.clock.first_step()
            with clocks("train"):
                factor = lr_factor(step - 1, total_steps, trial.schedule.warmup_fraction,
                                   trial.schedule.final_lr_fraction)
                micro = [[next(b) for b in batches] for _ in range(trial.grad_accum)]
                micro = [[(x.to(device), y.to(device)) for x, y in pairs] for pairs in micro]
                loss = stack.step(micro, factor, alive)
                for k in (~torch.isfinite(loss) & alive).nonzero().flatten().tolist():
                    diverged_at[k] = step
                    sessions[k].log({"diverged": 1.0}, step)
                    sessions[k].info("[train] %s diverged at step %d", jobs[k].trial.label, step)
                alive = alive & torch.isfinite(loss)
                losses = loss.tolist()
                timed = step % t.log_interval == 0 or step == total_steps
                if timed:
                    now = time.perf_counter()
                    per_s = (step - interval_from) * task.units_per_step / (now - interval_start)
                    interval_start, interval_from = now, step
                for k in range(k_members):
                    if k in diverged_at:
                        continue
                    metrics = {"loss": losses[k], "lr": jobs[k].trial.lr * factor,
                               f"{task.unit}_seen": step * task.units_per_step}
                    if timed:  # each member's own rate: the stack's over K
                        metrics[f"{task.unit}_per_s"] = per_s
                        metrics["flops_per_s"] = per_s * task.flops_per_unit
                        metrics["mfu"] = metrics["flops_per_s"] / peak_flops
                    sessions[k].log(metrics, step)
                if timed:
                    eta = (now - start) / (step - start_step) * (total_steps - step)
                    session.info("[train] step %d/%d | loss %s | %s %s x %d | eta %.0fs", step,
                                 total_steps, " ".join(f"{v:.4f}" for v in losses),
                                 f"{per_s:,.0f}", rate, k_members, eta)
                    for s in sessions:
                        s.flush()
            if step % t.eval_interval == 0 and step < total_steps:
                paused = time.perf_counter()
                scores = validate(step)
                with clocks("checkpoint"):
                    for k in range(k_members):
                        if k not in diverged_at:  # a restart re-runs its divergence
                            checkpoint(k, step, scores[k])
                interval_start += time.perf_counter() - paused  # throughput: training alone
            if not alive.any():
                break

        finals = validate(total_steps)
        train_wall = time.perf_counter() - start
        out = []
        for k in range(k_members):
            if k in diverged_at:
                done = {**{name: math.nan for name in task.headline}, "diverged": 1.0,
                        "diverged_step": float(diverged_at[k])}
            else:
                with sessions[k].clock.phase("eval"):
                    test = tasks[k].evaluate(engines[k], "test")
                test.update({"train_wall_s": train_wall, **sessions[k].efficiency(
                    task.flops_per_unit * task.units_per_step * (total_steps - start_step),
                    device)})
                sessions[k].log(test, total_steps)
                sessions[k].flush()
                done = {**finals[k], **test}
                tasks[k].keep(engines[k])  # before the final checkpoint, as Trainer.fit
            phases = sessions[k].clock.metrics()
            sessions[k].close()
            checkpoint(k, total_steps, {**done, **phases})
            out.append(done)
        return out
