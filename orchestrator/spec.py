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
    """A strict pydantic model with every ``ModelConfig`` field, all optional, plus
    ``d_mlp_scale``: multiply the size preset's ``d_mlp`` (parameter-matched CEM MLPs, Fig. 2b)."""
    hints = typing.get_type_hints(ModelConfig)
    fields = {f.name: (hints[f.name] | None, None) for f in dataclasses.fields(ModelConfig)}
    fields["d_mlp_scale"] = (float | None, Field(None, gt=0))
    return create_model("ModelOverrides", __base__=_Strict, **fields)


ModelOverrides = _overrides_model()


class DataSpec(_Strict):
    """The corpus: ``shakespeare`` (embedded default), local ``text_files`` (a glob) or
    ``slimpajama`` (streamed from the Hugging Face hub, ``max_documents`` of it).

    ``tokenizer``: a pretrained Hugging Face tokenizer (e.g. the paper's
    ``hf-internal-testing/llama-tokenizer``); unset trains a byte-level BPE of ``vocab_size``.
    """

    source: Literal["shakespeare", "text_files", "slimpajama"] = "shakespeare"
    paths: str | None = Field(None, validate_default=True)
    max_documents: int | None = Field(None, gt=0)
    tokenizer: str | None = None
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
    """Token budget, batch geometry, optimizer (paper Table 2 defaults), evaluation, engine.

    Budget: ``tokens`` when given, else Chinchilla, ``tokens_per_param`` x the total parameters of
    the Llama baseline of the trial's size x ``budget_scale`` (the CEM twin gets the same tokens).
    Batch: ``batch_size`` sequences per optimizer step over all workers; each worker runs
    micro-batches of at most ``micro_batch_size`` and accumulates gradients over the rest.
    """

    tokens: int | None = Field(None, gt=0, description="fixed training tokens per trial")
    tokens_per_param: float = Field(20.0, gt=0, description="Chinchilla tokens per parameter")
    budget_scale: float = Field(1.0, gt=0, description="multiplies the Chinchilla budget (CPU)")
    batch_size: int = Field(128, gt=0, description="global batch, sequences per optimizer step")
    micro_batch_size: int = Field(8, gt=0, description="most sequences per worker per pass")
    beta1: float = Field(OptimConfig.beta1, ge=0, lt=1)
    beta2: float = Field(OptimConfig.beta2, ge=0, lt=1)
    eps: float = Field(OptimConfig.eps, gt=0)
    weight_decay: float = Field(OptimConfig.weight_decay, ge=0)
    grad_clip: float = Field(OptimConfig.grad_clip, gt=0)
    warmup_fraction: float = Field(OptimConfig.warmup_fraction, ge=0, lt=1)
    final_lr_fraction: float = Field(OptimConfig.final_lr_fraction, ge=0, le=1)
    eval_interval: int = Field(50, gt=0, description="optimizer steps between validations "
                               "(and checkpoints)")
    eval_sequences: int = Field(128, gt=0, description="validation sequences per evaluation")
    log_interval: int = Field(10, gt=0)
    energy_diagnostics: bool = Field(
        False, description="log per-layer per-step energies and preconditioner eigenvalues")
    zero_stage: Literal[0, 1, 2, 3] = 2
    precision: Literal["auto", "bf16", "fp32"] = "auto"

    def optim_config(self, lr: float) -> OptimConfig:
        return OptimConfig(lr=lr, **{f.name: getattr(self, f.name)
                                     for f in dataclasses.fields(OptimConfig) if f.name != "lr"})

    def micro_batch(self, num_workers: int) -> tuple[int, int]:
        """``(micro_batch_size, grad_accum)`` per worker for ``num_workers`` workers: the largest
        micro-batch <= ``micro_batch_size`` that divides the worker's share of the global batch."""
        share = self.batch_size // num_workers
        micro = max(m for m in range(1, min(share, self.micro_batch_size) + 1) if share % m == 0)
        return micro, share // micro


class GPSpec(_Strict):
    """The synthetic Gaussian-process regression study (paper App. D, Table 3).

    Inputs x ~ N(0, I) in ``input_dim`` dimensions; targets f(x) + noise with f drawn jointly from
    a zero-mean GP with each kernel of ``kernels`` (``rbf``: squared exponential with length scale
    sqrt(input_dim); ``nonstationary``: Gibbs kernel whose length scale varies with x).
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


class ResourcesSpec(_Strict):
    """Ray Train workers of one trial; Ray Tune runs as many trials at once as the cluster fits."""

    num_workers: int = Field(2, gt=0)
    cpus_per_worker: int = Field(1, gt=0)
    use_gpu: bool = False

    def trials_that_fit(self, cpus: float, gpus: float = 0) -> int:
        """How many trials of this shape fit at once on ``cpus`` CPUs and ``gpus`` GPUs
        (at least 1)."""
        fit = int(cpus // (self.num_workers * self.cpus_per_worker))
        if self.use_gpu:
            fit = min(fit, int(gpus // self.num_workers))
        return max(1, fit)


PAPER_LEARNING_RATES = [0.0005, 0.001, 0.002, 0.004, 0.008]


class ExperimentSpec(_Strict):
    """One experiment: every size x variant x learning rate x seed is a trial (x kernel for the
    GP workload), each a Ray Train run under Ray Tune and a nested MLflow run.

    ``variants`` maps a name to ``ModelConfig`` overrides (e.g. ``{attention: cem}``);
    ``sizes`` are preset names (``micro``, ``llama-134m``, ...).
    """

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9._-]+$")
    description: str = ""
    workload: Literal["language_model", "gp_regression"] = "language_model"
    data: DataSpec = DataSpec()
    gp: GPSpec = GPSpec()
    sizes: list[str] = Field(min_length=1)
    variants: dict[str, ModelOverrides] = Field(min_length=1)  # type: ignore[valid-type]
    learning_rates: list[float] = Field(PAPER_LEARNING_RATES, min_length=1)
    seeds: list[int] = Field([0], min_length=1)
    training: TrainingSpec = TrainingSpec()
    resources: ResourcesSpec = ResourcesSpec()

    @field_validator("learning_rates")
    @classmethod
    def _positive_distinct(cls, lrs: list[float]) -> list[float]:
        if any(lr <= 0 for lr in lrs):
            raise ValueError("every learning rate must be > 0")
        if len(set(lrs)) != len(lrs):
            raise ValueError("learning rates must be distinct")
        return sorted(lrs)

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
        if self.training.batch_size % self.resources.num_workers:
            raise _FieldError(("training", "batch_size"),
                              f"{self.training.batch_size} is not a multiple of "
                              f"resources.num_workers = {self.resources.num_workers}")
        if self.data.source == "slimpajama" and not self.data.max_documents:
            raise _FieldError(("data", "max_documents"), "required when source is slimpajama")
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
        scale = overrides.pop("d_mlp_scale", None)
        if scale is not None:
            overrides.setdefault("d_mlp", round(PRESETS[size].d_mlp * scale))
        return ModelConfig.from_preset(size, **overrides)

    def baseline_model(self, size: str, vocab_size: int | None = None) -> ModelConfig:
        """The Llama baseline of ``size`` (the preset's dimensions, Llama sublayers), whose total
        parameters set the Chinchilla budget."""
        p = PRESETS[size]
        return ModelConfig(vocab_size=vocab_size or self.data.vocab_size, d_model=p.d_model,
                           n_layer=p.n_layer, n_head=p.n_head, d_mlp=p.d_mlp,
                           context_length=p.context_length)

    def datasets(self) -> list[str]:
        """The trial datasets: one corpus, or one per GP kernel."""
        if self.workload == "gp_regression":
            return [f"gp-{k}" for k in self.gp.kernels]
        return [self.data.source]


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
