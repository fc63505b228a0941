"""The typed objects that cross from the orchestrator to the workers: a trial's ``Budget``, the
``Trial`` itself, the ``Job`` that carries it to its workers, and a workload's ``Prepared``
data; and the phases a trial's wall time is split into."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from pydantic import BaseModel

    from workloads.core.architecture import ModelConfig
    from workloads.core.config import (
        EngineConfig,
        OptimizerConfig,
        ResourcesConfig,
        ScheduleConfig,
        TrainingConfig,
    )

D = TypeVar("D")  # what a workload's data preparation hands to the workers

# The phases of a worker's train loop, reported as ``time/<phase>_s``: from the hand-over to
# the first train step, the compiling first step, train steps, evaluation, checkpoints.
PHASES = ("startup", "compile", "train", "eval", "checkpoint")


@dataclass(frozen=True)
class Prepared(Generic[D]):
    """The driver-side result of ``Workload.prepare``.

    ``data`` crosses to every worker of every trial (it must be small: paths, not arrays);
    ``metrics`` are logged at step 0 of every trial run (e.g. the corpus's unigram perplexity);
    ``summary`` is one line for the log.
    """

    data: D
    metrics: dict[str, float] = field(default_factory=dict)
    summary: str = ""


@dataclass(frozen=True)
class Budget:
    """What one trial of a model costs: ``steps`` optimizer steps over ``units`` training tokens
    (examples for a workload without tokens), ``flops`` forward + backward in all, and
    ``params``: the ``count_parameters`` roles plus ``non_embedding``."""

    steps: int
    units: int
    flops: float
    params: dict[str, int]


@dataclass(frozen=True)
class Trial:
    """One training run of a grid, planned once by the orchestrator and handed unchanged to the
    train loop: its grid coordinates, resolved model, the workload's own section (``config``),
    the shared sections each component builds from (``training``, ``optimizer``, ``schedule``,
    ``engine``, ``resources``; the engine's precision fixed when planned), its budget and its
    batch geometry.

    ``batch_size = micro_batch_size x grad_accum x resources.num_workers``.
    """

    trial_id: str
    workload: str
    dataset: str
    variant: str
    size: str
    lr: float
    seed: int
    model: ModelConfig
    config: BaseModel
    training: TrainingConfig
    optimizer: OptimizerConfig
    schedule: ScheduleConfig
    engine: EngineConfig
    resources: ResourcesConfig
    budget: Budget
    micro_batch_size: int
    grad_accum: int

    @property
    def label(self) -> str:
        return f"{self.variant}@{self.size} lr={self.lr:g} seed={self.seed}"

    @property
    def steps(self) -> int:
        return self.budget.steps

    @property
    def tokens(self) -> int:
        return self.budget.units

    @property
    def params(self) -> dict[str, int]:
        return self.budget.params


@dataclass(frozen=True)
class Job:
    """One trial as it travels to its Ray Train workers (or runs in-process): the ``Trial``, the
    prepared data of its workload, the MLflow run its metrics go to (none in-process), and when
    (UNIX seconds) its driver handed it to Ray Train, or its worker group turned to it after the
    trial before (``submitted_at``; the start of ``time/startup_s``); ``earlier_runs``: the
    directories, on the storage root's filesystem, of Ray Train runs that trained it before (in
    another pack of trials), whose checkpoints it may resume from."""

    trial: Trial
    data: Any = None
    tracking_uri: str | None = None
    run_id: str | None = None
    submitted_at: float | None = None
    earlier_runs: tuple[str, ...] = ()


def stack_key(trial: Trial) -> Trial:
    """What the members of one stack of trials share (``workloads.runtime.stacked``): ``trial``
    without its id, learning rate and seed."""
    return dataclasses.replace(trial, trial_id="", lr=0.0, seed=0)
