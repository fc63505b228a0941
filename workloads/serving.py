"""A trained model as a package that stands on its own, and its MLflow pyfunc flavour.

A package is a directory: ``model.safetensors`` (the weights, in their training dtype),
``config.json`` (the ``ModelConfig``) and ``tokenizer.json`` (the corpus's HF tokenizer).
Nothing in it is a pickle: loading reads tensors and JSON, and the pyfunc is an MLflow "model
from code" (``serving_model.py``) whose code, ``workloads.models`` and this module, travels in
the MLflow model's ``code/`` directory, so ``mlflow.pyfunc.load_model`` needs no checkout of
CEM Lab, only the pinned requirements (torch, safetensors, tokenizers, pandas, numpy,
mlflow-skinny).

This module imports nothing of CEM Lab but ``workloads.models``.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import warnings
from importlib.metadata import version
from pathlib import Path

import mlflow.pyfunc
import pandas as pd
import torch
from mlflow.models import ModelSignature
from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema
from safetensors import safe_open
from safetensors.torch import load_model, save_model
from tokenizers import Tokenizer

from workloads.models import DecoderLM, ModelConfig, build_model
from workloads.models.inference import generate, token_nll

WEIGHTS, CONFIG, TOKENIZER = "model.safetensors", "config.json", "tokenizer.json"
EOT = "<|endoftext|>"  # the corpus tokenizer's document separator: context for a text's start
PACKAGE = "package"  # the pyfunc's artifact: the package directory

SIGNATURE = ModelSignature(
    inputs=Schema([ColSpec("string", "text")]),
    outputs=Schema([ColSpec("long", "token_count"), ColSpec("double", "nll"),
                    ColSpec("double", "perplexity")]),
    params=ParamSchema([ParamSpec("task", "string", "score"),
                        ParamSpec("max_new_tokens", "long", 64),
                        ParamSpec("temperature", "double", 1.0),
                        ParamSpec("top_k", "long", 0),
                        ParamSpec("seed", "long", 0)]))


def save_package(model: DecoderLM, tokenizer_json: str | Path, directory: str | Path) -> None:
    """Write ``model`` (weights in their dtype, config) and the tokenizer file into
    ``directory`` (created)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dtype = next(model.parameters()).dtype
    save_model(model, str(directory / WEIGHTS), metadata={"dtype": str(dtype).split(".")[-1]})
    (directory / CONFIG).write_text(json.dumps(model.cfg.to_dict(), indent=2) + "\n")
    shutil.copyfile(tokenizer_json, directory / TOKENIZER)


def load_config(directory: str | Path) -> ModelConfig:
    """The ``ModelConfig`` of the package in ``directory``.

    Raises:
        FileNotFoundError: no ``config.json`` there (e.g. a model registered before packages).
    """
    return ModelConfig(**json.loads((Path(directory) / CONFIG).read_text()))


def load_decoder(directory: str | Path, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None) -> DecoderLM:
    """The ``DecoderLM`` of the package in ``directory``, in eval mode, on ``device``, in
    ``dtype``: by default the one it was saved in (bf16 weights stay bf16); another one builds
    the model in it (its RoPE tables computed in it) and casts the weights.

    Raises:
        FileNotFoundError: ``config.json`` or ``model.safetensors`` missing.
        RuntimeError: weights that do not match the config (missing or unexpected tensors).
    """
    weights = Path(directory) / WEIGHTS
    if dtype is None:
        with safe_open(str(weights), "pt") as f:
            dtype = getattr(torch, (f.metadata() or {}).get("dtype", "float32"))
    model = build_model(load_config(directory)).to(dtype)
    load_model(model, str(weights), device=str(device))
    return model.to(device).eval()


class CEMLabLM(mlflow.pyfunc.PythonModel):
    """The pyfunc of a CEM Lab language model.

    ``predict(df)``, ``df`` a DataFrame with a string column ``text``: per text ``token_count``
    (tokens predicted), ``nll`` (their summed negative log-likelihood, nats) and ``perplexity``
    (``exp(nll / token_count)``), each text scored from a document start as in training.
    With ``params={"task": "generate", "max_new_tokens", "temperature", "top_k", "seed"}``:
    per text its ``continuation`` (sampled; temperature 0 is greedy).

    Raises:
        ValueError: an unknown task, a missing ``text`` column, an empty text to score.
    """

    def load_context(self, context) -> None:
        directory = context.artifacts[PACKAGE]
        self.model = load_decoder(directory)
        self.tokenizer = Tokenizer.from_file(str(Path(directory) / TOKENIZER))
        self.eot = self.tokenizer.token_to_id(EOT)

    def _ids(self, text: str) -> list[int]:
        return [self.eot, *self.tokenizer.encode(text).ids]

    def predict(self, context, model_input: pd.DataFrame, params: dict | None = None,
                ) -> pd.DataFrame:
        p = {s.name: s.default for s in SIGNATURE.params.params} | (params or {})
        if "text" not in model_input:
            raise ValueError(f"the input needs a 'text' column, got {list(model_input.columns)}")
        texts = [str(t) for t in model_input["text"]]
        if p["task"] == "generate":
            return pd.DataFrame({"continuation": [self.tokenizer.decode(generate(
                self.model, self._ids(t), int(p["max_new_tokens"]), float(p["temperature"]),
                int(p["top_k"]), int(p["seed"]), stop_id=self.eot)) for t in texts]})
        if p["task"] != "score":
            raise ValueError(f"params task must be 'score' or 'generate', got {p['task']!r}")
        rows = []
        for text in texts:
            ids = self._ids(text)
            if len(ids) < 2:
                raise ValueError("cannot score an empty text")
            n, nll = token_nll(self.model, ids)
            rows.append({"token_count": n, "nll": nll, "perplexity": math.exp(nll / n)})
        return pd.DataFrame(rows, columns=["token_count", "nll", "perplexity"])


def requirements() -> list[str]:
    """The pinned requirements of a pyfunc package: what this environment runs."""
    return [f"{name}=={version(name).split('+')[0]}"
            for name in ("mlflow-skinny", "torch", "safetensors", "tokenizers", "pandas",
                         "numpy")]


def save_pyfunc(model: DecoderLM, tokenizer_json: str | Path, path: str | Path) -> None:
    """Save ``model`` as an MLflow pyfunc model at ``path`` (must not exist): the package as its
    artifact, the model code as ``code/workloads`` (``workloads/models`` and this module
    only), the signature, the pinned requirements. No pickle is written."""
    here = Path(__file__).parent
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        package, code = Path(tmp) / PACKAGE, Path(tmp) / "workloads"
        save_package(model, tokenizer_json, package)
        shutil.copytree(here / "models", code / "models",
                        ignore=shutil.ignore_patterns("__pycache__"))
        for name in ("__init__.py", "serving.py"):
            shutil.copyfile(here / name, code / name)
        warnings.filterwarnings("ignore", message=".*input example was not provided")
        mlflow.pyfunc.save_model(  # no input example: validating one loads the model again
            str(path), python_model=str(here / "serving_model.py"),
            artifacts={PACKAGE: str(package)}, code_paths=[str(code)], signature=SIGNATURE,
            pip_requirements=requirements())
