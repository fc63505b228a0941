"""Experiment specs: YAML (safe_load) into strict pydantic models.

Unknown keys, wrong types and missing corpus files are rejected at load time with one line that
names the field (``SpecError``), before any Ray or MLflow work starts.
"""

from __future__ import annotations

import dataclasses
import glob
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)

from workloads.data import CorpusConfig
from workloads.models import PRESETS, ModelConfig
from workloads.optim import OptimConfig


class SpecError(ValueError):
    """A spec that cannot run; ``str()`` is one line naming the offending field."""


class _FieldError(ValueError):
    """Raised inside a model validator to report a specific field (``loc``) of the spec."""

    def __init__(self, loc: tuple, msg: str) -> None:
        super().__init__(msg)
        self.loc, self.msg = loc, msg


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _overrides_model() -> type[BaseModel]:
    """A strict pydantic model with every ``ModelConfig`` field, all optional."""
    hints = typing.get_type_hints(ModelConfig)
    fields = {f.name: (hints[f.name] | None, None) for f in dataclasses.fields(ModelConfig)}
    return create_model("ModelOverrides", __base__=_Strict, **fields)


ModelOverrides = _overrides_model()


class DataSpec(_Strict):
    """The corpus: ``shakespeare`` (embedded default) or local ``text_files`` (a glob)."""

    source: Literal["shakespeare", "text_files"] = "shakespeare"
    paths: str | None = Field(None, validate_default=True)
    vocab_size: int = Field(4096, ge=258, le=2**20)
    val_fraction: float = Field(0.05, gt=0, lt=0.5)
    test_fraction: float = Field(0.05, gt=0, lt=0.5)
    split_seed: int = 0

    @field_validator("paths")
    @classmethod
    def _paths_match(cls, paths: str | None, info: ValidationInfo) -> str | None:
        if info.data.get("source") != "text_files":
            return paths
        if not paths:
            raise ValueError("required when source is text_files (a glob of text files)")
        if not any(Path(p).is_file() for p in glob.glob(paths, recursive=True)):
            raise ValueError(f"no corpus file matches {paths!r}")
        return paths

    def corpus_config(self) -> CorpusConfig:
        return CorpusConfig(**self.model_dump())


class TrainingSpec(_Strict):
    """Token budget, batch geometry, optimizer (paper Table 2 defaults), evaluation, engine."""

    tokens: int = Field(gt=0, description="training tokens per trial")
    batch_size: int = Field(16, gt=0, description="global batch, sequences per optimizer step")
    micro_batch_size: int = Field(8, gt=0, description="sequences per worker per forward pass")
    lr: float = Field(OptimConfig.lr, gt=0)
    beta1: float = Field(OptimConfig.beta1, ge=0, lt=1)
    beta2: float = Field(OptimConfig.beta2, ge=0, lt=1)
    eps: float = Field(OptimConfig.eps, gt=0)
    weight_decay: float = Field(OptimConfig.weight_decay, ge=0)
    grad_clip: float = Field(OptimConfig.grad_clip, gt=0)
    warmup_fraction: float = Field(OptimConfig.warmup_fraction, ge=0, lt=1)
    final_lr_fraction: float = Field(OptimConfig.final_lr_fraction, ge=0, le=1)
    eval_interval: int = Field(50, gt=0, description="optimizer steps between validations")
    eval_sequences: int = Field(128, gt=0, description="validation sequences per evaluation")
    log_interval: int = Field(10, gt=0)
    energy_diagnostics: bool = Field(
        False, description="log per-layer per-step energies and preconditioner eigenvalues")
    zero_stage: Literal[0, 1, 2, 3] = 2
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    seed: int = 0

    def optim_config(self) -> OptimConfig:
        return OptimConfig(**{f.name: getattr(self, f.name)
                              for f in dataclasses.fields(OptimConfig)})


class ResourcesSpec(_Strict):
    """Ray Train workers of one trial."""

    num_workers: int = Field(2, gt=0)
    cpus_per_worker: int = Field(1, gt=0)
    use_gpu: bool = False


class ExperimentSpec(_Strict):
    """One experiment: every size x variant is a trial, each one MLflow run.

    ``variants`` maps a name to ``ModelConfig`` overrides (e.g. ``{attention: cem}``);
    ``sizes`` are preset names (``micro``, ``llama-134m``, ...).
    """

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9._-]+$")
    description: str = ""
    data: DataSpec = DataSpec()
    sizes: list[str] = Field(min_length=1)
    variants: dict[str, ModelOverrides] = Field(min_length=1)  # type: ignore[valid-type]
    training: TrainingSpec
    resources: ResourcesSpec = ResourcesSpec()

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
        per_step = self.training.micro_batch_size * self.resources.num_workers
        if self.training.batch_size % per_step:
            raise _FieldError(("training", "batch_size"),
                              f"{self.training.batch_size} is not a multiple of micro_batch_size"
                              f" x resources.num_workers = {per_step}")
        for size in self.sizes:
            for name in self.variants:
                try:
                    self.resolve_model(size, name)
                except (ValueError, TypeError) as e:
                    raise _FieldError(("variants", name), f"{e} (size {size})") from None
        return self

    def resolve_model(self, size: str, variant: str) -> ModelConfig:
        """The resolved ``ModelConfig`` of one trial (vocabulary from ``data.vocab_size``)."""
        overrides = self.variants[variant].model_dump(exclude_none=True)
        overrides.setdefault("vocab_size", self.data.vocab_size)
        return ModelConfig.from_preset(size, **overrides)


def _first_error(e: ValidationError) -> tuple[str, str]:
    err = e.errors()[0]
    ctx_err = (err.get("ctx") or {}).get("error")
    if isinstance(ctx_err, _FieldError):
        return ".".join(map(str, ctx_err.loc)), ctx_err.msg
    loc = ".".join(str(p) for p in err["loc"]) or "spec"
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
        loc, msg = _first_error(e)
        more = e.error_count() - 1
        raise SpecError(f"{source}: {loc}: {msg}" + (f" (+{more} more)" if more else "")) from None


def load_spec(path: str | Path) -> ExperimentSpec:
    """Read and validate the YAML spec at ``path``.

    Raises:
        SpecError: unreadable file, invalid YAML, or an invalid spec (one line naming the field).
    """
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise SpecError(f"{path}: cannot read spec: {e.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        raise SpecError(f"{path}: invalid YAML{where}: {getattr(e, 'problem', e)}") from None
    return parse_spec(data, str(path))
