"""The spec sections every workload shares, each the config of the component that builds from
it: ``budget`` (the workload's budget), ``training`` (the Trainer), ``optimizer`` and
``schedule`` (runtime.optim), ``engine`` (runtime.engine) and ``resources`` (Ray Train's
workers).

They are the runtime configs themselves (pydantic, strict, frozen): the orchestrator validates a
spec into them and the same objects reach the train loop inside the Ray workers.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, field_validator


class StrictModel(BaseModel):
    """A frozen pydantic model that rejects unknown keys (a spec typo is an error, not a no-op),
    values of the wrong type (no ``"0.1"`` or ``true`` for a number: pydantic's strict mode) and
    NaN or infinite floats."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class BudgetConfig(StrictModel):
    """The ``budget`` section: how many training tokens a trial gets (the workload's
    ``budget`` turns them into steps).

    ``tokens`` when given, else Chinchilla: ``tokens_per_param`` x the total parameters of the
    Llama baseline of the trial's size x ``budget_scale`` (one number, or one per size, e.g.
    ``{nano: 1.0, tiny: 0.25}``); the CEM twin of a size gets the same tokens.
    """

    tokens: int | None = Field(None, gt=0, description="fixed training tokens per trial")
    tokens_per_param: float = Field(20.0, gt=0, description="Chinchilla tokens per parameter")
    budget_scale: PositiveFloat | dict[str, PositiveFloat] = Field(
        1.0, description="multiplies the Chinchilla budget (CPU): a number, or one per size")

    def scale_for(self, size: str) -> float:
        """``budget_scale`` of preset ``size``.

        Raises:
            KeyError: a per-size ``budget_scale`` without ``size``.
        """
        if isinstance(self.budget_scale, dict):
            return self.budget_scale[size]
        return self.budget_scale


class TrainingConfig(StrictModel):
    """The ``training`` section: what the ``Trainer`` takes, the batch and the intervals.

    ``batch_size`` sequences (examples) per optimizer step over all workers; each worker runs
    micro-batches of at most ``micro_batch_size`` and accumulates gradients over the rest.
    """

    batch_size: int = Field(128, gt=0, description="global batch, sequences per optimizer step")
    micro_batch_size: int = Field(8, gt=0, description="most sequences per worker per pass")
    eval_interval: int = Field(50, gt=0, description="optimizer steps between validations "
                               "(and checkpoints)")
    eval_sequences: int = Field(128, gt=0, description="validation sequences per evaluation")
    log_interval: int = Field(10, gt=0)
    energy_diagnostics: bool = Field(
        False, description="log per-layer per-step energies, descent, update norms, attention "
        "entropies and preconditioner eigenvalues")
    eval_steps: list[int] = Field(
        default_factory=list, description="test-time recursion: after training, the test split "
        "again with every CEM sublayer at each of these numbers of steps T_eval, eta per step "
        "as trained and scaled by T_train / T_eval (workloads.lm.recursion)")

    @field_validator("eval_steps")
    @classmethod
    def _distinct_positive(cls, steps: list[int]) -> list[int]:
        if any(t < 1 for t in steps) or len(set(steps)) != len(steps):
            raise ValueError("recursion steps must be distinct integers >= 1")
        return sorted(steps)


class OptimizerConfig(StrictModel):
    """The ``optimizer`` section (``runtime.optim.build_optimizer``): AdamW with paper Table 2's
    defaults, weight decay on projection and embedding weights only
    (``optim.decayed_parameters``), and gradient clipping at ``grad_clip`` (global norm)."""

    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-9, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    grad_clip: float = Field(1.0, gt=0)


class ScheduleConfig(StrictModel):
    """The ``schedule`` section (``runtime.optim.build_scheduler``): linear warmup over
    ``warmup_fraction`` of the steps, then a cosine decay to ``final_lr_fraction`` x the peak
    learning rate."""

    warmup_fraction: float = Field(0.05, ge=0, lt=1)
    final_lr_fraction: float = Field(0.1, ge=0, le=1)


# DeepSpeed config keys (key: None, or key: its sub-key) that ``engine.deepspeed`` may not set.
DEEPSPEED_OWNED: dict[str, str | None] = {
    "train_batch_size": None, "train_micro_batch_size_per_gpu": None,
    "gradient_accumulation_steps": None, "gradient_clipping": None, "optimizer": None,
    "scheduler": None, "fp16": None, "amp": None, "torch_autocast": None,
    "bf16": "enabled", "zero_optimization": "stage"}


class EngineConfig(StrictModel):
    """The ``engine`` section (``runtime.engine``): DeepSpeed's ZeRO ``zero_stage``, the
    ``precision`` (``auto``: fixed when the trial is planned, ``core.precision``),
    ``compile`` (whether DeepSpeed's engine runs the model and the loss through
    ``torch.compile``; ``engine.compiles``; the plain PyTorch engine never compiles) and
    ``deepspeed``, more DeepSpeed config. The precision and
    ``deepspeed`` are part of a trial's identity, the ZeRO stage and compiling are not.

    Raises:
        pydantic.ValidationError: ``deepspeed`` sets a key another field owns.
    """

    zero_stage: Literal[0, 1, 2, 3] = 2
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    compile: bool | Literal["auto"] = Field(
        "auto", description="torch.compile each worker's model and loss (DeepSpeed's "
        "engine.compile); auto: on GPU workers at ZeRO stage 0-2, off on CPUs "
        "(engine.compiles). The plain PyTorch engine never compiles: a workload trained on it "
        "(Workload.backend ddp) refuses true")
    deepspeed: dict[str, Any] = Field(
        default_factory=dict, description="DeepSpeed config keys merged over the one the "
        "engine writes (runtime.optim.deepspeed_config), e.g. {bf16: {check_grad_overflow: "
        "false}}; the batch geometry, clipping, precision and ZeRO stage come from their own "
        "fields")

    @field_validator("deepspeed")
    @classmethod
    def _not_owned_elsewhere(cls, value: dict[str, Any]) -> dict[str, Any]:
        """Refuses a key that another field sets (``DEEPSPEED_OWNED``), naming it."""
        for key, inner in DEEPSPEED_OWNED.items():
            if key not in value:
                continue
            if inner is not None and not isinstance(value[key], dict):
                raise ValueError(f"{key} must be a mapping of DeepSpeed's {key} keys")
            if inner is None or inner in value[key]:
                where = key if inner is None else f"{key}.{inner}"
                raise ValueError(f"{where} is set by the spec's own fields (batch, "
                                 "optimizer.grad_clip, engine.precision, engine.zero_stage)")
        return value


# Where each key of the former single ``training`` section lives now ("section.key"): an old
# spec gets one line naming the new place.
MOVED = {**{k: f"budget.{k}" for k in BudgetConfig.model_fields},
         **{k: f"optimizer.{k}" for k in OptimizerConfig.model_fields},
         **{k: f"schedule.{k}" for k in ScheduleConfig.model_fields},
         **{k: f"engine.{k}" for k in EngineConfig.model_fields}}

# Trainer options and logging that do not change what a trial computes: out of its identity.
NOT_SCIENCE = frozenset({"micro_batch_size", "log_interval", "energy_diagnostics",
                         "eval_steps"})


def science(budget: BudgetConfig, training: TrainingConfig, optimizer: OptimizerConfig,
            schedule: ScheduleConfig, precision: str, deepspeed: dict[str, Any] | None = None,
            ) -> dict:
    """What of the sections changes what a trial computes, as one mapping (hashed into its
    id): the budget, the batch and evaluation, the optimizer, the schedule, the ``precision``
    it trains in and any ``engine.deepspeed`` config (some of its keys change the numbers: the
    accumulation dtype, the overflow check); not micro-batching, logging, the ZeRO stage or
    compiling. Without ``deepspeed`` the mapping, and so every id, is as it was without it."""
    return {**budget.model_dump(), **training.model_dump(exclude=NOT_SCIENCE),
            **optimizer.model_dump(), **schedule.model_dump(), "precision": precision,
            **({"deepspeed": deepspeed} if deepspeed else {})}


def deep_merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``extra``'s keys over it, mappings under the same key merged in turn."""
    out = dict(base)
    for key, value in extra.items():
        both = isinstance(value, dict) and isinstance(base.get(key), dict)
        out[key] = deep_merged(base[key], value) if both else value
    return out


# Host memory (GiB) of one trial's actors besides its workers: Ray Tune's trial driver and Ray
# Train's controller, placement-group cleaner, synchronization, preemption and dataset actors
# (measured with 16 nano trials at once on CPU: 1.05 GiB USS per trial). Ray reserves it with
# every trial, so that a grid queues trials rather than have Ray's memory monitor kill them.
TRIAL_ACTORS_GB = 1.1


class ResourcesConfig(StrictModel):
    """Ray Train workers of one trial; Ray Tune runs as many trials at once as the cluster fits
    (CPUs, GPUs and host memory)."""

    num_workers: int = Field(2, gt=0)
    cpus_per_worker: int = Field(1, gt=0)
    use_gpu: bool = False
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="how Ray places a trial's workers on nodes (STRICT_SPREAD: one "
        "per node)")
    max_failures: int = Field(2, ge=-1, description="times a trial restarts from its last "
                              "checkpoint after a worker or node dies, within one submission "
                              "(-1: no limit)")

    stack: int = Field(8, ge=1, description="most trials that differ only in learning rate "
                       "and seed one worker trains at once as one stacked model "
                       "(workloads.runtime.stacked; one worker, plain PyTorch engine on CPUs, "
                       "within memory_per_worker_gb); 1: each trial alone")
    reuse_workers: bool = Field(True, description="a worker group trains several trials "
                                "of this shape in turn (processes, data and, on GPUs, the "
                                "compiled model stay warm); false: a worker group per trial")
    memory_per_worker_gb: float = Field(1.0, gt=0, description="host memory (GiB) Ray "
                                        "reserves for each worker, beside TRIAL_ACTORS_GB per "
                                        "trial: trials wait for memory rather than run out")
    gpu_memory_gb: float | None = Field(None, gt=0, description="memory of each GPU (GiB): "
                                        "a spec whose trial needs more per GPU "
                                        "(workloads.lm.memory) is refused before anything runs")

    @property
    def memory_gb(self) -> float:
        """Host memory (GiB) one trial reserves: its workers' and its other actors'."""
        return self.num_workers * self.memory_per_worker_gb + TRIAL_ACTORS_GB

    def trials_that_fit(self, cpus: float, gpus: float = 0,
                        memory_gb: float | None = None) -> int:
        """How many trials of this shape fit at once on ``cpus`` CPUs, ``gpus`` GPUs and
        ``memory_gb`` GiB of host memory (None: not counted); at least 1."""
        fit = int(cpus // (self.num_workers * self.cpus_per_worker))
        if self.use_gpu:
            fit = min(fit, int(gpus // self.num_workers))
        if memory_gb is not None:
            fit = min(fit, int(memory_gb // self.memory_gb))
        return max(1, fit)
