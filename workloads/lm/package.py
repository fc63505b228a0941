"""A trained language model as a package that stands on its own: a directory of
``model.safetensors`` (the weights, in their training dtype), ``config.json`` (the
``ModelConfig``) and ``tokenizer.json`` (the corpus's HF tokenizer). Nothing in it is a pickle:
loading reads tensors and JSON. Its MLflow pyfunc flavour: ``serving``.

This module imports nothing of CEM Lab but ``workloads.models`` and the ``ModelConfig``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_model, save_model

from workloads.models import DecoderLM, ModelConfig, build_model

WEIGHTS, CONFIG, TOKENIZER = "model.safetensors", "config.json", "tokenizer.json"
EOT = "<|endoftext|>"  # the corpus tokenizer's document separator: context for a text's start
PACKAGE = "package"  # the package's directory among a pyfunc model's artifacts (``serving``)


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
