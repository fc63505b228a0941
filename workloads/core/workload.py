"""The ``Workload`` interface: what a kind of experiment (language modelling, GP regression, ...)
supplies to the orchestrator.

A workload owns its spec section and its data preparation, its trial planning (steps, FLOPs,
parameters, memory), its train loop, its test metric and, where it registers models, what a
registered model is and what can be done with one. The orchestrator talks to workloads through
this interface alone: adding a workload is one package with a ``Workload`` subclass and one
entry in ``workloads.core.registry.BUILTIN`` (or a ``register`` call).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Literal, TypeVar

from pydantic import BaseModel

from workloads.core.trial import Budget, Job, Prepared, Trial

if TYPE_CHECKING:
    import torch

    from workloads.core.architecture import ModelConfig
    from workloads.core.config import (
        BudgetConfig,
        EngineConfig,
        ResourcesConfig,
        TrainingConfig,
    )
    from workloads.core.storage import StorageRoot

C = TypeVar("C", bound=BaseModel)  # the workload's spec section
D = TypeVar("D")  # what its data preparation hands to the workers


class Workload(ABC, Generic[C, D]):
    """What a kind of experiment supplies to the orchestrator.

    Class attributes: ``name`` (the spec's ``workload:`` value), ``section`` (the spec key of its
    own config) and ``config_type`` (that section's pydantic model), ``metric`` (the test metric
    a trial is reported by, lower is better), ``selection_metric`` (its validation twin, by
    which learning rates and ``best`` models are chosen), ``unit`` (what ``Budget.units`` counts),
    ``micro_batches`` (whether a worker splits its share of the batch into micro-batches with
    gradient accumulation, or takes it whole), ``registers_models`` (whether the best trials go
    to the MLflow model registry), ``backend`` (the engine its trials train on under Ray Train:
    ``deepspeed``, DeepSpeed's, which compiles as ``engine.compile`` says; ``ddp``, the plain
    PyTorch engine with DDP, which never compiles), ``stackable`` (whether its trials that
    differ only in learning rate and seed may train as one stacked model on one worker,
    ``train_loop_per_worker``'s ``stacks``).
    """

    name: ClassVar[str]
    section: ClassVar[str]
    config_type: ClassVar[type[BaseModel]]
    metric: ClassVar[str]
    selection_metric: ClassVar[str]
    unit: ClassVar[str] = "tokens"
    micro_batches: ClassVar[bool] = True
    registers_models: ClassVar[bool] = False
    backend: ClassVar[Literal["deepspeed", "ddp"]] = "deepspeed"
    stackable: ClassVar[bool] = False

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
    def budget(self, config: C, budget: BudgetConfig, training: TrainingConfig, size: str,
               model: ModelConfig) -> Budget:
        """Steps, training units, FLOPs and parameter counts of one trial of ``model`` at
        preset ``size``, from the ``budget`` and ``training`` (batch) sections."""

    @abstractmethod
    def calibration_step(self, config: C, model: ModelConfig, micro_batch_size: int,
                         device: torch.device, stack: int = 1,
                         ) -> tuple[Callable[[], None], float]:
        """A forward + backward step on random data and its FLOPs (for wall-time estimates);
        with ``stack`` > 1 (a ``stackable`` workload), the train step of that many models as
        one stacked model and the FLOPs of all."""

    def memory(self, model: ModelConfig, engine: EngineConfig, resources: ResourcesConfig,
               micro_batch_size: int, config: C | None = None) -> Any:
        """Memory one worker of a trial of ``model`` needs (its ``engine``'s ZeRO stage and
        precision, its workers, one micro-batch; ``config``: the workload's spec section, where
        the estimate depends on it), as an object with ``total`` (bytes) and ``describe()``
        (one line), or None where the workload has no estimate."""
        return None

    @abstractmethod
    def train_loop_per_worker(self, jobs: list[Job], stacks: tuple[int, ...] = ()) -> None:
        """What every Ray Train worker of a pack of same-shaped trials runs: each of ``jobs``
        in turn, reporting checkpoints to Ray Train (``workloads.core.pack``) and metrics to
        the job's MLflow run; ``stacks``: the sizes of the consecutive runs of ``jobs`` that
        train at once as one stacked model (empty: each alone; only where ``stackable``)."""

    @abstractmethod
    def train_here(self, job: Job, engine: str = "torch", profile_top: int = 0,
                   metrics_json: str | None = None) -> dict[str, float]:
        """Train ``job`` in this process with no Ray or MLflow (``engine``: ``torch`` or
        ``deepspeed``), print its report, and return its final metrics; ``profile_top``: the
        longest kernels of two profiled steps; ``metrics_json``: a file for every metric."""

    @abstractmethod
    def train_stack_here(self, jobs: list[Job]) -> list[dict[str, float]]:
        """Train ``jobs`` (trials that differ in learning rate and seed only) in this process
        as one stacked model on the plain PyTorch engine, print their report, and return each
        one's final metrics, in order.

        Raises:
            ValueError: the trials cannot share a stack.
        """

    # Registered models (``registers_models``): a trial's ``model`` artifact, and what can be
    # done with a downloaded one (``model_dir``: the artifact's directory).
    model_files: ClassVar[tuple[str, ...]] = ()  # files (relative) a registered model holds

    def model_card(self, name: str, experiment: str, trial: Trial, val: float, test: float,
                   commit: str | None, code: str | None) -> str:
        """The README (Markdown) of registered model ``name``: ``trial`` with its validation and
        test metric, the commit and code fingerprint it trained with."""
        raise NotImplementedError(f"workload {self.name} registers no models")

    def evaluate_model(self, model_dir: Path, tags: dict[str, str], data_dir: Path,
                       split: str, batch_size: int = 8,
                       recursion: dict[str, float] | None = None) -> float:
        """The test metric of the model in ``model_dir`` recomputed on ``split`` of the data its
        registration ``tags`` name; with ``recursion`` (``attn_steps``, ``mlp_steps``,
        ``step_size_scale``), run at those recursion steps instead of its own."""
        raise NotImplementedError(f"workload {self.name} registers no models")

    def probe_model(self, model_dir: Path, tags: dict[str, str], data_dir: Path, split: str,
                    sequences: int) -> list[dict]:
        """Rows of a probe of the model in ``model_dir`` on ``sequences`` of ``split``."""
        raise NotImplementedError(f"workload {self.name} registers no models")

    def export_model(self, model_dir: Path, directory: Path) -> Path:
        """Write the model in ``model_dir`` in another library's format into ``directory``;
        returns what to load."""
        raise NotImplementedError(f"workload {self.name} registers no models")
