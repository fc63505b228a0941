"""The GP-regression workload (paper App. D, Table 3): stacked recursive CEM MLPs fit functions
drawn from Gaussian processes; test RMSE decides (lower is better).

Spec section ``gp`` (``GPConfig``); each kernel is a dataset of the grid. Nothing is prepared on
the driver: every worker draws the same data from ``data_seed``. Under Ray Train the replicas are
kept in step by DDP (``prepare_model``); in-process the same loop runs on one device.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from workloads.core.architecture import ModelConfig
from workloads.core.config import (
    BudgetConfig,
    EngineConfig,
    ResourcesConfig,
    StrictModel,
    TrainingConfig,
)
from workloads.core.precision import planned_precision
from workloads.core.trial import Budget, Job, Prepared
from workloads.gp.data import sample_gp_regression
from workloads.gp.memory import GPMemoryEstimate, estimate_memory
from workloads.gp.regressor import GPRegressor, gp_flops_per_sample
from workloads.models.shapes import shapes_only
from workloads.runtime.engine import Engine
from workloads.runtime.session import Session
from workloads.runtime.trainer import Task
from workloads.runtime.worker import TrainedWorkload


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
    with shapes_only():
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


class GPRegression(TrainedWorkload):
    """GP regression with a ``GPRegressor`` per trial."""

    name = "gp_regression"
    section = "gp"
    config_type = GPConfig
    metric = "test_rmse"
    selection_metric = "val_rmse"
    unit = "examples"
    micro_batches = False  # each worker takes its share of the batch in one pass
    backend = "ddp"  # the plain PyTorch engine: engine.compile true is refused

    def datasets(self, config: GPConfig) -> list[str]:
        return [f"gp-{k}" for k in config.kernels]

    def identity(self, config: GPConfig, data: None = None) -> dict:
        return config.model_dump(exclude={"kernels"})  # the kernel is the trial's dataset

    def prepare(self, config: GPConfig, data_dir: str) -> Prepared[None]:
        return Prepared(None)

    def budget(self, config: GPConfig, budget: BudgetConfig, training: TrainingConfig,
               size: str, model: ModelConfig) -> Budget:
        """``gp.steps`` steps of ``training.batch_size`` examples."""
        examples = config.steps * training.batch_size
        return Budget(config.steps, examples,
                      gp_flops_per_sample(model, config.input_dim) * examples,
                      gp_parameter_counts(model, config.input_dim))

    def memory(self, model: ModelConfig, engine: EngineConfig, resources: ResourcesConfig,
               micro_batch_size: int, config: GPConfig | None = None,
               ) -> GPMemoryEstimate | None:
        """``workloads.gp.memory.estimate_memory`` in bytes: the regressor's fp32 weights,
        gradients and AdamW moments on each DDP worker, one micro-batch's activations in the
        planned precision, and the data of ``config`` (the N x N float64 matrices of its draw:
        host memory, before training). None without ``config``: the input width and the
        number of points are there."""
        if config is None:
            return None
        n = config.n_train + config.n_val + config.n_test
        return estimate_memory(
            model, gp_parameter_counts(model, config.input_dim)["total"], config.input_dim, n,
            config.kernels, micro_batch_size, resources.num_workers,
            planned_precision(engine.precision, resources.use_gpu), resources.use_gpu)

    def calibration_step(self, config: GPConfig, model: ModelConfig, micro_batch_size: int,
                         device: torch.device, stack: int = 1,
                         ) -> tuple[Callable[[], None], float]:
        """One forward + backward of a worker's batch of random inputs (GP trials train
        alone: ``stack`` is 1)."""
        n = micro_batch_size
        net = GPRegressor(model, config.input_dim).to(device)
        x = torch.randn(n, config.input_dim, device=device)

        def step() -> None:
            net(x).square().mean().backward()
        return step, gp_flops_per_sample(model, config.input_dim) * n

    def task(self, job: Job, session: Session) -> GPRegressionTask:
        return GPRegressionTask(job, session)


class GPRegressionTask(Task):
    """One worker's share of a GP-regression trial for the ``Trainer``: a ``GPRegressor`` fit
    by mean squared error on examples drawn with replacement from the training set (the same
    ``data_seed`` data on every worker, each its own draws), ``val_rmse`` and ``test_rmse``.
    The replicas keep in step by DDP."""

    backend, unit = GPRegression.backend, "examples"
    headline = ("val_rmse", "test_rmse")

    def __init__(self, job: Job, session: Session) -> None:
        self.trial, self.session, g = job.trial, session, job.trial.config
        self.kernel = self.trial.dataset.removeprefix("gp-")
        self.data = sample_gp_regression(self.kernel, g.input_dim, g.n_train, g.n_val, g.n_test,
                                         g.noise_std, g.data_seed)
        self.units_per_step = self.trial.training.batch_size
        self.flops_per_unit = gp_flops_per_sample(self.trial.model, g.input_dim)
        self.describe = f"{self.kernel} kernel, T={self.trial.model.mlp_steps}"

    def build_model(self) -> GPRegressor:
        return GPRegressor(self.trial.model, self.trial.config.input_dim)

    def batches(self, skip: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Draws of the worker's whole share of the batch (no micro-batching), from a generator
        of its own per trial seed and rank."""
        x, y = self.data.x["train"], self.data.y["train"]
        rng = torch.Generator().manual_seed(self.trial.seed * 1_000_003 + self.session.rank)
        for drawn in itertools.count():
            idx = torch.randint(len(x), (self.trial.micro_batch_size,), generator=rng)
            if drawn >= skip:
                yield x[idx], y[idx]

    def loss(self, engine: Engine, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(engine(x.to(engine.device)), y.to(engine.device))

    def evaluate(self, engine: Engine, split: str) -> dict[str, float]:
        prefix = "val" if split == "validation" else split
        return {f"{prefix}_rmse": rmse(engine, self.data.x[split], self.data.y[split])}
