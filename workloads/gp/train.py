"""The GP-regression training loop of one Ray Train worker (plain PyTorch DDP).

``train_gp_per_worker(job)`` is handed to ``ray.train.torch.TorchTrainer``; ``job`` is
``GPJob.to_dict()``. Ray is imported inside it, never at module level.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from workloads.gp.data import sample_gp_regression
from workloads.gp.model import GPRegressor
from workloads.metrics import MetricSink
from workloads.models import ModelConfig
from workloads.optim import OptimConfig, build_optimizer, build_scheduler

log = logging.getLogger("cemlab.gp")
_STATE = "gp_state.pt"


@dataclass(frozen=True)
class GPJob:
    """One GP trial as plain data: model, data draw, optimizer, ``steps`` optimizer steps of
    ``batch_size`` examples (split over the workers), evaluation every ``eval_interval`` steps."""

    model: dict[str, Any]
    kernel: str
    input_dim: int
    n_train: int
    n_val: int
    n_test: int
    noise_std: float
    data_seed: int
    optim: dict[str, Any]
    steps: int
    batch_size: int
    eval_interval: int = 100
    log_interval: int = 50
    seed: int = 0
    threads_per_worker: int = 1
    tracking_uri: str | None = None
    run_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@torch.no_grad()
def rmse(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Root mean squared error of ``model`` on (N, d) inputs and (N,) targets."""
    model.eval()
    out = math.sqrt(F.mse_loss(model(x), y).item())
    model.train()
    return out


def train_gp_per_worker(job_dict: dict[str, Any]) -> None:
    """Fit a ``GPRegressor`` by AdamW on mean squared error; report and log metrics.

    Per step ``loss`` (MSE, mean over workers) and ``lr``; every ``eval_interval`` steps
    ``val_rmse`` and a checkpoint (model, optimizer, schedule, step) through
    ``ray.train.report``, from which a resubmitted trial resumes. At the end ``test_rmse``,
    ``val_rmse`` and ``train_wall_s``.
    """
    import ray.train
    import ray.train.torch

    from workloads.checkpoint import report_with_checkpoint, restore_checkpoint

    job = GPJob(**job_dict)
    torch.set_num_threads(job.threads_per_worker)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.manual_seed(job.seed)
    data = sample_gp_regression(job.kernel, job.input_dim, job.n_train, job.n_val, job.n_test,
                                job.noise_std, job.data_seed)
    net = GPRegressor(ModelConfig(**job.model), job.input_dim)
    optim_cfg = OptimConfig(**job.optim)
    optimizer = build_optimizer(net, optim_cfg)
    scheduler = build_scheduler(optimizer, optim_cfg, job.steps)
    start_step = 0
    restored = restore_checkpoint(
        lambda d: torch.load(os.path.join(d, _STATE), weights_only=True))
    if restored:
        state, _ = restored
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_step = state["step"]
    model = ray.train.torch.prepare_model(net)
    sink = MetricSink(job.tracking_uri, job.run_id, enabled=rank == 0)
    per_worker = max(job.batch_size // world, 1)
    g = torch.Generator().manual_seed(job.seed * 1_000_003 + rank)
    x_train, y_train = data.x["train"], data.y["train"]
    if rank == 0:
        log.info("[gp] %s kernel, T=%d: steps %d..%d", job.kernel, net.cfg.mlp_steps,
                 start_step + 1, job.steps)

    def report(step: int, metrics: dict[str, float]) -> None:
        def save(d: str) -> None:  # the replicas are identical: rank 0 writes the state
            if rank == 0:
                torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                            "scheduler": scheduler.state_dict(), "step": step},
                           os.path.join(d, _STATE))
        report_with_checkpoint(step, metrics, save)

    start = time.perf_counter()
    for step in range(start_step + 1, job.steps + 1):
        idx = torch.randint(len(x_train), (per_worker,), generator=g)
        loss = F.mse_loss(model(x_train[idx]), y_train[idx])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), optim_cfg.grad_clip)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        metrics = {"loss": loss.item(), "lr": lr}
        sink.log(metrics, step)
        if step % job.eval_interval == 0 and step < job.steps:
            val = {"val_rmse": rmse(net, data.x["validation"], data.y["validation"])}
            sink.log(val, step)
            sink.flush()
            report(step, val)
        if rank == 0 and step % job.log_interval == 0:
            log.info("[gp] step %d/%d | mse %.4f | lr %.2e", step, job.steps, loss.item(), lr)
    final = {"val_rmse": rmse(net, data.x["validation"], data.y["validation"]),
             "test_rmse": rmse(net, data.x["test"], data.y["test"]),
             "train_wall_s": time.perf_counter() - start}
    sink.log(final, job.steps)
    sink.flush()
    if rank == 0:
        log.info("[gp] done: test RMSE %.4f (noise %.3f)", final["test_rmse"], job.noise_std)
    report(job.steps, final)
