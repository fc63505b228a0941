"""The ``Workload`` interface, the typed ``Trial`` and ``Job`` that cross to Ray workers, and the
registry of workloads.

A workload (language modelling, GP regression, ...) owns its spec section and its data
preparation, its trial planning (steps, FLOPs, parameters) and its train loop, and names its
test metric. The orchestrator only ever talks to this interface: adding a workload is one module
that subclasses ``Workload`` plus one ``register`` line (``workloads/registry.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from pydantic import BaseModel

from workloads.config import ResourcesConfig, TrainingConfig
from workloads.models import ModelConfig

if TYPE_CHECKING:
    import torch

    from workloads.session import Session
    from workloads.storage import StorageRoot

C = TypeVar("C", bound=BaseModel)  # the workload's spec section
D = TypeVar("D")  # what its data preparation hands to the workers


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
    train loop: its grid coordinates, resolved model, shared spec sections, the workload's own
    section (``config``), its budget and its batch geometry.

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
    (UNIX seconds) its driver handed it to Ray Train (``submitted_at``; the start of
    ``time/startup_s``)."""

    trial: Trial
    data: Any = None
    tracking_uri: str | None = None
    run_id: str | None = None
    submitted_at: float | None = None


class Workload(ABC, Generic[C, D]):
    """What a kind of experiment supplies to the orchestrator.

    Class attributes: ``name`` (the spec's ``workload:`` value), ``section`` (the spec key of its
    own config) and ``config_type`` (that section's pydantic model), ``metric`` (the test metric
    a trial is reported by, lower is better), ``selection_metric`` (its validation twin, by
    which learning rates and ``best`` models are chosen), ``unit`` (what ``Budget.units`` counts),
    ``micro_batches`` (whether a worker splits its share of the batch into micro-batches with
    gradient accumulation, or takes it whole), ``registers_models`` (whether the best trials go
    to the MLflow model registry).
    """

    name: ClassVar[str]
    section: ClassVar[str]
    config_type: ClassVar[type[BaseModel]]
    metric: ClassVar[str]
    selection_metric: ClassVar[str]
    unit: ClassVar[str] = "tokens"
    micro_batches: ClassVar[bool] = True
    registers_models: ClassVar[bool] = False

    def datasets(self, config: C) -> list[str]:
        """The dataset names a spec's grid runs over (one trial per dataset and grid point)."""
        return [self.name]

    def identity(self, config: C, data: D | None = None) -> dict[str, Any]:
        """What of ``config`` (and of the prepared ``data``, when given) changes what a trial
        computes (hashed into its id)."""
        return config.model_dump()

    def vocab_size(self, config: C, data: D | None) -> int | None:
        """The vocabulary every model of the grid gets (None: the preset's)."""
        return None

    @abstractmethod
    def prepare(self, config: C, data_dir: str) -> Prepared[D]:
        """Make the data ready on the driver (download, tokenize, cache under ``data_dir``)."""

    def publish(self, data: D, storage: StorageRoot) -> D:
        """Put prepared data where every node reaches it (the storage root); returns what the
        workers then receive. Default: the data needs no files (nothing to publish)."""
        return data

    @abstractmethod
    def budget(self, config: C, training: TrainingConfig, size: str, model: ModelConfig,
               ) -> Budget:
        """Steps, training units, FLOPs and parameter counts of one trial of ``model``."""

    @abstractmethod
    def calibration_step(self, config: C, model: ModelConfig, micro_batch_size: int,
                         device: torch.device) -> tuple[Callable[[], None], float]:
        """A forward + backward step on random data and its FLOPs (for wall-time estimates)."""

    @abstractmethod
    def train(self, job: Job, session: Session) -> dict[str, float]:
        """The train loop of one worker: train ``job.trial`` to its budget, reporting through
        ``session``; returns the final metrics (``metric`` among them)."""
