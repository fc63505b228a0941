"""Experiment specs: YAML (safe_load) into strict pydantic models. This module only validates.

The sections are the runtime configs themselves, each owned by the component that builds from
it (``workloads.core.config``): ``budget``, ``training``, ``optimizer``, ``schedule``,
``engine``, ``resources``, and the workload's own section (``data`` for the language
model, ``gp`` for GP regression: whatever ``Workload.section`` and ``config_type`` say), so the
objects validated here are the ones the workers use. Unknown keys, wrong types and missing corpus
files are rejected at load time with one line that names the field (``SpecError``), before any
Ray or MLflow work starts.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    Field,
    NonNegativeInt,
    SerializeAsAny,
    ValidationError,
    create_model,
    field_validator,
    model_serializer,
    model_validator,
)

from orchestrator.planning.spec_yaml import SpecFileError, read_spec_yaml
from workloads.core.architecture import PRESETS, ModelConfig
from workloads.core.config import (
    MOVED,
    BudgetConfig,
    EngineConfig,
    OptimizerConfig,
    ResourcesConfig,
    ScheduleConfig,
    StrictModel,
    TrainingConfig,
)
from workloads.core.registry import get_workload, workloads
from workloads.core.workload import Workload


class SpecError(ValueError):
    """A spec that cannot run; ``str()`` is one line naming the offending field."""


class _FieldError(ValueError):
    """Raised inside a model validator to report a specific field (``loc``) of the spec."""

    def __init__(self, loc: tuple, msg: str) -> None:
        super().__init__(msg)
        self.loc, self.msg = loc, msg


class _Variant(StrictModel):
    """Base of ``Variant``: turns overrides into a trial's ``ModelConfig``."""

    def resolve(self, size: str, vocab_size: int | None = None) -> ModelConfig:
        """Preset ``size`` with these overrides; ``d_mlp_scale`` multiplies the preset's
        ``d_mlp`` (parameter-matched CEM MLPs, Fig. 2b); ``vocab_size`` applies unless
        overridden.

        Raises:
            ValueError, TypeError: the overrides make an invalid ``ModelConfig``.
        """
        overrides = self.model_dump(exclude_none=True)
        if vocab_size is not None:
            overrides.setdefault("vocab_size", vocab_size)
        scale = overrides.pop("d_mlp_scale", None)
        if scale is not None:
            overrides.setdefault("d_mlp", round(PRESETS[size].d_mlp * scale))
        return ModelConfig.from_preset(size, **overrides)


def _variant_model() -> type[_Variant]:
    """A strict pydantic model with every ``ModelConfig`` field, all optional, plus
    ``d_mlp_scale``."""
    hints = typing.get_type_hints(ModelConfig)
    fields = {f.name: (hints[f.name] | None, None) for f in dataclasses.fields(ModelConfig)}
    fields["d_mlp_scale"] = (float | None, Field(None, gt=0))
    return create_model("Variant", __base__=_Variant, **fields)


Variant = _variant_model()

PAPER_LEARNING_RATES = [0.0005, 0.001, 0.002, 0.004, 0.008]


def _sorted_learning_rates(lrs: list[float]) -> list[float]:
    """``lrs`` sorted; each must be positive and distinct (else ValueError)."""
    if any(lr <= 0 for lr in lrs):
        raise ValueError("every learning rate must be > 0")
    if len(set(lrs)) != len(lrs):
        raise ValueError("learning rates must be distinct")
    return sorted(lrs)


class LearningRateGrid(StrictModel):
    """``learning_rates`` as a bracket that adapts (``orchestrator.science.brackets``): the
    ``grid``, and with ``extend`` an arm whose validation optimum sits at an edge of its learning
    rates gets the next point beyond that edge (the grid's log spacing there), round after
    round, until its optimum is interior or it has ``max_points`` learning rates. ``eval_seeds``:
    fresh seeds that, once the brackets settle, train once per arm at the learning rate chosen
    on the tuning seeds' (``seeds``) mean validation; the claims read their test metric."""

    grid: list[float] = Field(min_length=1)
    extend: bool = True
    max_points: int = Field(8, gt=0)
    eval_seeds: list[NonNegativeInt] = []

    @field_validator("grid")
    @classmethod
    def _sorted(cls, lrs: list[float]) -> list[float]:
        return _sorted_learning_rates(lrs)

    @field_validator("eval_seeds")
    @classmethod
    def _distinct_eval_seeds(cls, seeds: list[int]) -> list[int]:
        if len(set(seeds)) != len(seeds):
            raise ValueError("seeds must be distinct")
        return seeds

    @model_validator(mode="after")
    def _room_to_extend(self) -> LearningRateGrid:
        if self.extend and len(self.grid) < 2:
            raise _FieldError(("grid",), "extending needs at least two "
                              "learning rates (the spacing to continue)")
        if self.extend and self.max_points < len(self.grid):
            raise _FieldError(("max_points",), f"{self.max_points} is fewer "
                              f"than the grid's {len(self.grid)} learning rates")
        return self


class ExperimentSpec(StrictModel):
    """One experiment: every dataset x size x variant x learning rate x seed is a trial, each a
    Ray Train run under Ray Tune and a nested MLflow run.

    ``workload`` names a registered ``Workload``; its section (e.g. ``data:``) is validated by the
    workload's ``config_type`` into ``workload_config``. ``variants`` maps a name to
    ``ModelConfig`` overrides (e.g. ``{attention: cem}``); ``sizes`` are preset names.
    """

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9._-]+$")
    description: str = ""
    workload: str = "language_model"
    workload_config: SerializeAsAny[BaseModel]
    sizes: list[str] = Field(min_length=1)
    variants: dict[str, Variant] = Field(min_length=1)  # type: ignore[valid-type]
    learning_rates: Annotated[list[float], Field(min_length=1)] | LearningRateGrid = \
        PAPER_LEARNING_RATES
    seeds: list[NonNegativeInt] = Field([0], min_length=1)
    budget: BudgetConfig = BudgetConfig()
    training: TrainingConfig = TrainingConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    engine: EngineConfig = EngineConfig()
    resources: ResourcesConfig = ResourcesConfig()

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        """A key of the former single ``training`` section names its section now."""
        training = data.get("training") if isinstance(data, dict) else None
        for key in training if isinstance(training, dict) else ():
            if key in MOVED:
                raise _FieldError(("training", key), f"moved to {MOVED[key]}")
        return data

    @model_validator(mode="before")
    @classmethod
    def _workload_section(cls, data: Any) -> Any:
        """Validate the workload's own section into ``workload_config``."""
        if not isinstance(data, dict) or "workload_config" in data:
            return data
        data = dict(data)
        name = data.get("workload", "language_model")
        try:
            workload = get_workload(name)
        except (KeyError, TypeError) as e:
            raise _FieldError(("workload",), str(e).strip("'\"")) from None
        for other in workloads().values():
            if other.section != workload.section and other.section in data:
                raise _FieldError((other.section,), f"unknown key (workload {workload.name} "
                                  f"takes '{workload.section}')")
        section = data.pop(workload.section, None) or {}
        try:
            data["workload_config"] = workload.config_type.model_validate(section)
        except ValidationError as e:
            loc, msg = _first_error(e, section)
            raise _FieldError((workload.section, loc), msg) from None
        return data

    @functools.cached_property
    def workload_impl(self) -> Workload:
        """The registered ``Workload`` named by ``workload`` (looked up once per spec)."""
        return get_workload(self.workload)

    @property
    def grid_size(self) -> int:
        """Trials in the grid: datasets x sizes x variants x learning rates x seeds (counted,
        not planned)."""
        datasets = self.workload_impl.datasets(self.workload_config)
        return (len(datasets) * len(self.sizes) * len(self.variants) * len(self.lr_grid)
                * len(self.seeds))

    @model_serializer(mode="wrap")
    def _section_key(self, handler) -> dict[str, Any]:
        """Dump the workload's section under its spec key (``data:``, ``gp:``), as written."""
        out = handler(self)
        out[self.workload_impl.section] = out.pop("workload_config")
        return out

    @field_validator("learning_rates", mode="before")
    @classmethod
    def _bracket(cls, value: Any) -> Any:
        """A mapping is a ``LearningRateGrid``, its errors named under ``learning_rates``."""
        if not isinstance(value, dict):
            return value
        try:
            return LearningRateGrid.model_validate(value)
        except ValidationError as e:
            err = e.errors()[0]
            inner = (err.get("ctx") or {}).get("error")
            loc, msg = ((inner.loc, inner.msg) if isinstance(inner, _FieldError) else
                        (err["loc"], "unknown key" if err["type"] == "extra_forbidden"
                         else err["msg"].removeprefix("Value error, ")))
            raise _FieldError(("learning_rates", *map(str, loc)), msg) from None

    @field_validator("learning_rates")
    @classmethod
    def _positive_distinct(cls, lrs: list[float] | LearningRateGrid,
                           ) -> list[float] | LearningRateGrid:
        return _sorted_learning_rates(lrs) if isinstance(lrs, list) else lrs

    @property
    def lr_grid(self) -> list[float]:
        """The learning rates every arm trains at first (``learning_rates`` or its ``grid``),
        ascending."""
        lrs = self.learning_rates
        return lrs if isinstance(lrs, list) else lrs.grid

    @property
    def lr_max_points(self) -> int | None:
        """How many learning rates an arm may reach when its brackets extend; None when they
        do not (a fixed grid)."""
        lrs = self.learning_rates
        return lrs.max_points if isinstance(lrs, LearningRateGrid) and lrs.extend else None

    @property
    def eval_seeds(self) -> list[int]:
        """The evaluation seeds (``learning_rates.eval_seeds``), trained at each arm's chosen
        learning rate; none for a plain list of learning rates."""
        lrs = self.learning_rates
        return lrs.eval_seeds if isinstance(lrs, LearningRateGrid) else []

    @field_validator("seeds")
    @classmethod
    def _distinct_seeds(cls, seeds: list[int]) -> list[int]:
        if len(set(seeds)) != len(seeds):
            raise ValueError("seeds must be distinct")
        return seeds

    @field_validator("sizes")
    @classmethod
    def _known_presets(cls, sizes: list[str]) -> list[str]:
        unknown = [s for s in sizes if s not in PRESETS]
        if unknown:
            raise ValueError(f"unknown preset(s) {', '.join(unknown)}; known: "
                             f"{', '.join(PRESETS)}")
        return sizes

    @model_validator(mode="after")
    def _consistent(self) -> ExperimentSpec:
        both = sorted(set(self.eval_seeds) & set(self.seeds))
        if both:
            raise _FieldError(("learning_rates", "eval_seeds"),
                              f"seed(s) {', '.join(map(str, both))} also tune (seeds): an "
                              "evaluation seed must be fresh")
        if self.training.batch_size % self.resources.num_workers:
            raise _FieldError(("training", "batch_size"),
                              f"{self.training.batch_size} is not a multiple of "
                              f"resources.num_workers = {self.resources.num_workers}")
        scales = self.budget.budget_scale
        if isinstance(scales, dict) and set(scales) != set(self.sizes):
            raise _FieldError(("budget", "budget_scale"),
                              f"needs one scale per size {sorted(self.sizes)}, got "
                              f"{sorted(scales)}")
        models = {}
        for size in self.sizes:
            for name, variant in self.variants.items():
                try:
                    models[name, size] = variant.resolve(size)
                except (ValueError, TypeError) as e:
                    raise _FieldError(("variants", name), f"{e} (size {size})") from None
        self._recursion_runs(models)
        self._fits_gpus(models)
        self._compiles()
        return self

    def _compiles(self) -> None:
        """Refuse ``engine.compile: true`` for a workload trained on the plain PyTorch engine
        (``Workload.backend`` ``ddp``): only DeepSpeed's engine compiles (``auto`` is off
        there, as it is on CPUs)."""
        if self.engine.compile is True and self.workload_impl.backend != "deepspeed":
            raise _FieldError(("engine", "compile"), (
                f"workload {self.workload} trains on the plain PyTorch engine (DDP), which "
                "does not compile: set it to auto or false"))

    def _recursion_runs(self, models: dict[tuple[str, str], ModelConfig]) -> None:
        """Refuse ``training.eval_steps`` that no variant can use (no CEM sublayer) or that a
        variant's config refuses at some T_eval (e.g. step-scope momentum at T = 1)."""
        steps = self.training.eval_steps
        if not steps:
            return
        cem = {key: m for key, m in models.items() if "cem" in (m.attention, m.mlp)}
        if not cem:
            raise _FieldError(("training", "eval_steps"), "no variant has a CEM sublayer to "
                              "run at other recursion steps")
        for (name, size), m in cem.items():
            for t in steps:
                try:
                    dataclasses.replace(m, attn_steps=t if m.attention == "cem" else m.attn_steps,
                                        mlp_steps=t if m.mlp == "cem" else m.mlp_steps)
                except ValueError as e:
                    raise _FieldError(("training", "eval_steps"),
                                      f"T_eval {t}: {e} (variant {name}, size {size})") from None

    def _fits_gpus(self, models: dict[tuple[str, str], ModelConfig]) -> None:
        """Refuse a trial whose estimated memory per GPU (``Workload.memory`` at the spec's
        ``micro_batch_size``) exceeds ``resources.gpu_memory_gb``; ``models``: each (variant,
        size)'s resolved config."""
        r, t, e = self.resources, self.training, self.engine
        if not (r.use_gpu and r.gpu_memory_gb):
            return
        for (name, size), model in models.items():
            need = self.workload_impl.memory(model, e, r, t.micro_batch_size,
                                             self.workload_config)
            if need is not None and need.total > r.gpu_memory_gb * 2**30:
                raise _FieldError(("resources", "gpu_memory_gb"), (
                    f"{name}@{size} needs about {need.describe()} per GPU with ZeRO "
                    f"{e.zero_stage} on {r.num_workers} GPU(s) at micro_batch_size "
                    f"{t.micro_batch_size}, more than the {r.gpu_memory_gb:g} GiB given: "
                    "lower training.micro_batch_size, raise engine.zero_stage or add GPUs"))


def _field_names() -> frozenset[str]:
    """Every field name of the spec's models (its sections, variants, workload sections)."""
    models = [ExperimentSpec, BudgetConfig, TrainingConfig, OptimizerConfig, ScheduleConfig,
              EngineConfig, ResourcesConfig, Variant,
              *(w.config_type for w in workloads().values())]
    return frozenset(name for m in models for name in m.model_fields)


def _input_path(loc: tuple, data: Any) -> list:
    """The parts of a pydantic error location that name the spec's fields: keys and indices of
    ``data`` and field names (missing ones too), not a union's branch tags
    (``constrained-float``, ``dict[str,constrained-float]``)."""
    fields, path = _field_names(), []
    for part in loc:
        if isinstance(data, dict) and part in data:
            data = data[part]
        elif isinstance(data, list) and isinstance(part, int) and 0 <= part < len(data):
            data = data[part]
        elif part in fields and isinstance(data, dict | None):
            data = None  # a field with no input: missing, or given a default
        else:
            continue
        path.append(part)
    return path


def _first_error(e: ValidationError, data: Any) -> tuple[str, str]:
    """``(field.path, problem)`` of the first error of validating ``data``."""
    err = e.errors()[0]
    ctx_err = (err.get("ctx") or {}).get("error")
    if isinstance(ctx_err, _FieldError):
        return ".".join(map(str, ctx_err.loc)), ctx_err.msg
    loc = ".".join(str(p) for p in _input_path(err["loc"], data)) or "spec"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg = "unknown key"
    return loc, msg


def parse_spec(data: Any, source: str = "spec") -> ExperimentSpec:
    """Validate a loaded spec mapping.

    Raises:
        SpecError: one line, ``<source>: <field.path>: <problem>``.
    """
    if not isinstance(data, dict):
        raise SpecError(f"{source}: expected a mapping at the top level, got "
                        f"{type(data).__name__}")
    try:
        return ExperimentSpec.model_validate(data)
    except ValidationError as e:
        loc, msg = _first_error(e, data)
        more = e.error_count() - 1
        raise SpecError(f"{source}: {loc}: {msg}" + (f" (+{more} more)" if more else "")) from None


def load_spec(path: str | Path) -> ExperimentSpec:
    """Read and validate the YAML spec at ``path`` (``spec_yaml.read_spec_yaml``).

    Raises:
        SpecError: unreadable, oversized or non-UTF-8 file, invalid YAML (a duplicate key, an
            alias bomb), or an invalid spec (one line naming the field).
    """
    try:
        data = read_spec_yaml(path)
    except SpecFileError as e:
        raise SpecError(f"{path}: {e}") from None
    return parse_spec(data, str(path))
