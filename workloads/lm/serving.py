"""The MLflow pyfunc flavour of a language-model package (``package``): scoring and generation.

The pyfunc is an MLflow "model from code" (``serving_model.py``) whose artifact is the package
and whose code, ``workloads.models``, the ``ModelConfig`` (``workloads.core.architecture``), the
package format and this module, travels in the MLflow model's ``code/`` directory (``CODE``),
so ``mlflow.pyfunc.load_model`` needs no checkout of CEM Lab, only the pinned requirements
(torch, safetensors, tokenizers, pandas, numpy, mlflow-skinny). Nothing is unpickled.

This module imports nothing of CEM Lab but ``workloads.models``, the ``ModelConfig`` and the
package format.
"""

from __future__ import annotations

import math
import shutil
import tempfile
import warnings
from importlib.metadata import version
from pathlib import Path

import mlflow.pyfunc
import pandas as pd
from mlflow.models import ModelSignature
from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema
from tokenizers import Tokenizer

from workloads.lm.package import EOT, PACKAGE, TOKENIZER, load_decoder, save_package
from workloads.models import DecoderLM
from workloads.models.inference import generate, token_nll
from workloads.models.test_time import Steps, at_steps

# What a pyfunc model carries of CEM Lab (paths under the workloads package): the models, the
# ModelConfig they are built from, and this module with the packages around it.
CODE = ("__init__.py", "core/__init__.py", "core/architecture.py", "models", "lm/__init__.py",
        "lm/package.py", "lm/serving.py")

SIGNATURE = ModelSignature(
    inputs=Schema([ColSpec("string", "text")]),
    outputs=Schema([ColSpec("long", "token_count"), ColSpec("double", "nll"),
                    ColSpec("double", "perplexity")]),
    params=ParamSchema([ParamSpec("task", "string", "score"),
                        ParamSpec("max_new_tokens", "long", 64),
                        ParamSpec("temperature", "double", 1.0),
                        ParamSpec("top_k", "long", 0),
                        ParamSpec("seed", "long", 0),
                        ParamSpec("attn_steps", "long", 0),  # 0: as trained
                        ParamSpec("mlp_steps", "long", 0),
                        ParamSpec("step_size_scale", "double", 1.0)]))


class CEMLabLM(mlflow.pyfunc.PythonModel):
    """The pyfunc of a CEM Lab language model.

    ``predict(df)``, ``df`` a DataFrame with a string column ``text``: per text ``token_count``
    (tokens predicted), ``nll`` (their summed negative log-likelihood, nats) and ``perplexity``
    (``exp(nll / token_count)``), each text scored from a document start as in training.
    With ``params={"task": "generate", "max_new_tokens", "temperature", "top_k", "seed"}``:
    per text its ``continuation`` (sampled; temperature 0 is greedy). Either task runs the model
    at other recursion steps with ``params`` ``attn_steps`` and ``mlp_steps`` (0: as trained)
    and ``step_size_scale`` (on every CEM step size; ``workloads.models.test_time``).

    Raises:
        ValueError: an unknown task, a missing ``text`` column, an empty text to score.
    """

    def load_context(self, context) -> None:
        directory = context.artifacts[PACKAGE]
        self.model = load_decoder(directory)
        self.tokenizer = Tokenizer.from_file(str(Path(directory) / TOKENIZER))
        self.eot = self.tokenizer.token_to_id(EOT)

    def _at(self, steps: Steps) -> DecoderLM:
        """The model at ``steps`` (itself when they are its own), built once per setting."""
        if steps == Steps():
            return self.model
        cache = self.__dict__.setdefault("_recursions", {})
        if steps not in cache:
            cache[steps] = at_steps(self.model, steps)
        return cache[steps]

    def _ids(self, text: str) -> list[int]:
        return [self.eot, *self.tokenizer.encode(text).ids]

    def predict(self, context, model_input: pd.DataFrame, params: dict | None = None,
                ) -> pd.DataFrame:
        p = {s.name: s.default for s in SIGNATURE.params.params} | (params or {})
        if "text" not in model_input:
            raise ValueError(f"the input needs a 'text' column, got {list(model_input.columns)}")
        texts = [str(t) for t in model_input["text"]]
        model = self._at(Steps(int(p["attn_steps"]) or None, int(p["mlp_steps"]) or None,
                               float(p["step_size_scale"])))
        if p["task"] == "generate":
            return pd.DataFrame({"continuation": [self.tokenizer.decode(generate(
                model, self._ids(t), int(p["max_new_tokens"]), float(p["temperature"]),
                int(p["top_k"]), int(p["seed"]), stop_id=self.eot)) for t in texts]})
        if p["task"] != "score":
            raise ValueError(f"params task must be 'score' or 'generate', got {p['task']!r}")
        rows = []
        for text in texts:
            ids = self._ids(text)
            if len(ids) < 2:
                raise ValueError("cannot score an empty text")
            n, nll = token_nll(model, ids)
            rows.append({"token_count": n, "nll": nll, "perplexity": math.exp(nll / n)})
        return pd.DataFrame(rows, columns=["token_count", "nll", "perplexity"])


def requirements() -> list[str]:
    """The pinned requirements of a pyfunc package: what this environment runs."""
    return [f"{name}=={version(name).split('+')[0]}"
            for name in ("mlflow-skinny", "torch", "safetensors", "tokenizers", "pandas",
                         "numpy")]


def save_pyfunc(model: DecoderLM, tokenizer_json: str | Path, path: str | Path) -> None:
    """Save ``model`` as an MLflow pyfunc model at ``path`` (must not exist): the package as its
    artifact, the model code as ``code/workloads`` (``CODE`` only), the signature, the pinned
    requirements. No pickle is written."""
    root = Path(__file__).parents[1]  # the workloads package
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        package, code = Path(tmp) / PACKAGE, Path(tmp) / "workloads"
        save_package(model, tokenizer_json, package)
        for name in CODE:
            (code / name).parent.mkdir(parents=True, exist_ok=True)
            if (root / name).is_dir():
                shutil.copytree(root / name, code / name,
                                ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copyfile(root / name, code / name)
        warnings.filterwarnings("ignore", message=".*input example was not provided")
        mlflow.pyfunc.save_model(  # no input example: validating one loads the model again
            str(path), python_model=str(root / "lm" / "serving_model.py"),
            artifacts={PACKAGE: str(package)}, code_paths=[str(code)], signature=SIGNATURE,
            pip_requirements=requirements())
