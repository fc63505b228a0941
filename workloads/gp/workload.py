"""The GP-regression workload (paper App. D, Table 3): stacked recursive CEM MLPs fit functions
drawn from Gaussian processes; test RMSE decides (lower is better).

Spec section ``gp`` (``GPConfig``); each kernel is a dataset of the grid. Nothing is prepared on
the driver: every worker draws the same data from ``data_seed``. Under Ray Train the replicas are
kept in step by DDP (``prepare_model``); in-process the same loop runs on one device.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from workloads.base import Budget, Job, Prepared, Workload
from workloads.config import StrictModel, TrainingConfig
from workloads.engine import Engine
from workloads.gp.data import sample_gp_regression
from workloads.gp.model import GPRegressor, gp_flops_per_sample
from workloads.models import ModelConfig
from workloads.session import Session


class GPConfig(StrictModel):
    """The ``gp`` section of a spec: the synthetic regression study.

    Inputs x ~ N(0, I) in ``input_dim`` dimensions; targets f(x) + noise with f drawn jointly from
    a zero-mean GP with each kernel of ``kernels`` (``rbf``: squared exponential with length scale
    sqrt(input_dim); ``nonstationary``: Gibbs kernel whose length scale varies with x). A trial
    runs ``steps`` optimizer steps of ``training.batch_size`` examples.
    """

    kernels: list[Literal["rbf", "nonstationary"]] = Field(["rbf", "nonstationary"],
                                                           min_length=1)
    input_dim: int = Field(10, gt=0)
    n_train: int = Field(2048, gt=0)
    n_val: int = Field(256, gt=0)
    n_test: int = Field(512, gt=0)
    noise_std: float = Field(0.05, ge=0)
    steps: int = Field(2000, gt=0, description="optimizer steps per trial")
    data_seed: int = 0


def gp_parameter_counts(cfg: ModelConfig, input_dim: int) -> dict[str, int]:
    """Parameters of a ``GPRegressor``: ``mlp`` (the CEM blocks), ``other`` (input map, norm,
    head); no embedding, so ``non_embedding`` is the total."""
    with torch.device("meta"):
        model = GPRegressor(cfg, input_dim)
    mlp = sum(p.numel() for p in model.blocks.parameters())
    total = sum(p.numel() for p in model.parameters())
    return {"total": total, "embedding": 0, "attention": 0, "mlp": mlp, "other": total - mlp,
            "non_embedding": total}


@torch.no_grad()
def rmse(engine: Engine, x: torch.Tensor, y: torch.Tensor) -> float:
    """Root mean squared error of the engine's model on (N, d) inputs and (N,) targets."""
    engine.eval()
    out = math.sqrt(F.mse_loss(engine(x.to(engine.device)), y.to(engine.device)).item())
    engine.train()
    return out


class GPRegression(Workload[GPConfig, None]):
    """GP regression with a ``GPRegressor`` per trial."""

    name = "gp_regression"
    section = "gp"
    config_type = GPConfig
    metric = "test_rmse"
    selection_metric = "val_rmse"
    unit = "examples"
    micro_batches = False  # each worker takes its share of the batch in one pass

    def datasets(self, config: GPConfig) -> list[str]:
        return [f"gp-{k}" for k in config.kernels]

    def identity(self, config: GPConfig, data: None = None) -> dict:
        return config.model_dump(exclude={"kernels"})  # the kernel is the trial's dataset

    def prepare(self, config: GPConfig, data_dir: str) -> Prepared[None]:
        return Prepared(None)

    def budget(self, config: GPConfig, training: TrainingConfig, size: str,
               model: ModelConfig) -> Budget:
        """``gp.steps`` steps of ``training.batch_size`` examples."""
        examples = config.steps * training.batch_size
        return Budget(config.steps, examples,
                      gp_flops_per_sample(model, config.input_dim) * examples,
                      gp_parameter_counts(model, config.input_dim))

    def calibration_step(self, config: GPConfig, model: ModelConfig, micro_batch_size: int,
                         device: torch.device) -> tuple[Callable[[], None], float]:
        """One forward + backward of a worker's batch of random inputs."""
        n = micro_batch_size
        net = GPRegressor(model, config.input_dim).to(device)
        x = torch.randn(n, config.input_dim, device=device)

        def step() -> None:
            net(x).square().mean().backward()
        return step, gp_flops_per_sample(model, config.input_dim) * n

    def train(self, job: Job, session: Session) -> dict[str, float]:
        """Fit a ``GPRegressor`` by AdamW on mean squared error; report and log metrics.

        Per step ``loss`` (MSE, mean over workers) and ``lr``; every ``eval_interval`` steps
        ``val_rmse`` and a checkpoint (model, optimizer, schedule, step), from which a
        resubmitted trial resumes. At the end ``test_rmse``, ``val_rmse``, ``train_wall_s``,
        ``train_mfu`` and ``peak_memory_mib`` (``Session.efficiency``), which it returns.
        """
        trial, g = job.trial, job.trial.config
        rank, world = session.rank, session.world_size
        torch.manual_seed(trial.seed)
        kernel = trial.dataset.removeprefix("gp-")
        data = sample_gp_regression(kernel, g.input_dim, g.n_train, g.n_val, g.n_test,
                                    g.noise_std, g.data_seed)
        engine = session.engine(GPRegressor(trial.model, g.input_dim), backend="ddp")
        start_step = session.restore(engine)
        per_worker = trial.micro_batch_size  # the worker's whole share of the batch
        rng = torch.Generator().manual_seed(trial.seed * 1_000_003 + rank)
        x_train, y_train = data.x["train"], data.y["train"]
        val = (data.x["validation"], data.y["validation"])
        session.info("[gp] %s kernel, T=%d: steps %d..%d", kernel, trial.model.mlp_steps,
                     start_step + 1, trial.steps)

        start = time.perf_counter()
        clock = session.clock
        for step in range(start_step + 1, trial.steps + 1):
            clock.first_step()
            with clock.phase("train"):
                idx = torch.randint(len(x_train), (per_worker,), generator=rng)
                loss = F.mse_loss(engine(x_train[idx].to(engine.device)),
                                  y_train[idx].to(engine.device))
                engine.backward(loss)
                lr = engine.lr()
                engine.step()
                mse = session.all_reduce(loss.detach().clone()).item() / world
                session.log({"loss": mse, "lr": lr}, step)
            if step % trial.training.eval_interval == 0 and step < trial.steps:
                with clock.phase("eval"):
                    metrics = {"val_rmse": rmse(engine, *val)}
                    session.log(metrics, step)
                    session.flush()
                with clock.phase("checkpoint"):
                    session.checkpoint(engine, step, metrics)
            if step % trial.training.log_interval == 0:
                session.info("[gp] step %d/%d | mse %.4f | lr %.2e", step, trial.steps, mse, lr)
        efficiency = session.efficiency(gp_flops_per_sample(trial.model, g.input_dim)
                                        * per_worker * world * (trial.steps - start_step),
                                        engine.device)
        with clock.phase("eval"):
            final = {"val_rmse": rmse(engine, *val),
                     "test_rmse": rmse(engine, data.x["test"], data.y["test"]),
                     "train_wall_s": time.perf_counter() - start, **efficiency}
            session.log(final, trial.steps)
            session.flush()
        session.info("[gp] done: test RMSE %.4f (noise %.3f)", final["test_rmse"], g.noise_std)
        session.checkpoint(engine, trial.steps, {**final, **clock.metrics()})
        return final
