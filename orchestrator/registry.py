"""The MLflow model registry: the best trial per (variant, size), and evaluating it again.

Registered models are named ``cemlab-<variant>-<size>``; alias ``best`` points at the version
with the lowest validation perplexity (chosen on validation, never on test); tags record its
trial hash, validation and test perplexity, parameters, tokens, data config and experiment.
"""

from __future__ import annotations

import math

import mlflow
import mlflow.pytorch
import torch
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from workloads.base import Trial
from workloads.data import CorpusConfig, prepare_corpus
from workloads.language_model import sequence_nll

ALIAS = "best"


def model_name(variant: str, size: str) -> str:
    return f"cemlab-{variant}-{size}"


def register_best(client: MlflowClient, experiment: str, trials: list[Trial],
                  results: dict[str, tuple[str, float, float]]) -> list[str]:
    """Register the best finished trial of every (variant, size), by validation perplexity,
    unless alias ``best`` already names a version at least as good on validation (so
    resubmitting registers nothing; a version from before validation was recorded counts as
    worse).

    ``results`` maps trial ids to ``(mlflow run id, validation perplexity, test perplexity)``.
    Returns ``name@alias -> version`` lines of what was registered.
    """
    best: dict[tuple[str, str], Trial] = {}
    for t in trials:
        if t.trial_id in results and (
                (t.variant, t.size) not in best
                or results[t.trial_id][1] < results[best[t.variant, t.size].trial_id][1]):
            best[t.variant, t.size] = t
    done = []
    for (variant, size), t in best.items():
        name = model_name(variant, size)
        run_id, val, test = results[t.trial_id]
        current = _alias_version(client, name)
        if current is not None and float(current.tags.get("val_perplexity", "inf")) <= val:
            continue
        if current is None and not client.search_registered_models(f"name = '{name}'"):
            try:
                client.create_registered_model(name, description=f"Best {variant} at size "
                                               f"{size} by validation perplexity (CEM Lab)")
            except MlflowException as e:  # a concurrent submission registered it first
                if e.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
        tags = {"trial_id": t.trial_id, "val_perplexity": repr(val),
                "test_perplexity": repr(test), "experiment": experiment,
                "variant": variant, "size": size, "lr": repr(t.lr), "seed": str(t.seed),
                "params_total": str(t.params["total"]),
                "params_non_embedding": str(t.params["non_embedding"]),
                "tokens": str(t.tokens), "data": t.config.model_dump_json(),
                "context_length": str(t.model.context_length)}
        client.create_model_version(name, f"runs:/{run_id}/model", run_id=run_id, tags=tags)
        version = _first_version_of_run(client, name, run_id)
        client.set_registered_model_alias(name, ALIAS, version.version)
        done.append(f"{name}@{ALIAS} -> version {version.version} ({t.label}, validation "
                    f"perplexity {val:.2f}, test {test:.2f})")
    return done


def _first_version_of_run(client: MlflowClient, name: str, run_id: str):
    """The oldest version of model ``name`` made from run ``run_id``, after deleting the later
    ones: two submissions that registered the same run at once both keep the oldest."""
    first, *later = sorted(client.search_model_versions(
        f"name = '{name}' and run_id = '{run_id}'"), key=lambda v: int(v.version))
    for v in later:
        try:
            client.delete_model_version(name, v.version)
        except MlflowException as e:  # the other submission deleted it first
            if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
    return first


def _alias_version(client: MlflowClient, name: str):
    try:
        return client.get_model_version_by_alias(name, ALIAS)
    except MlflowException:
        return None


def resolve(client: MlflowClient, ref: str):
    """The model version ``NAME@ALIAS``, ``NAME/VERSION`` or ``NAME`` (its ``best``).

    Raises:
        LookupError: no such model, alias or version (one line).
    """
    name, _, alias = ref.partition("@")
    name, _, version = name.partition("/")
    try:
        if version:
            return client.get_model_version(name, version)
        return client.get_model_version_by_alias(name, alias or ALIAS)
    except MlflowException as e:
        raise LookupError(f"{ref}: no such registered model version "
                          f"({e.message.splitlines()[0]})") from None


def list_rows(client: MlflowClient) -> list[dict]:
    """One row per registered CEM Lab model: its ``best`` version and headline tags."""
    rows = []
    for m in client.search_registered_models("name LIKE 'cemlab-%'", order_by=["name"]):
        v = _alias_version(client, m.name)
        tags = v.tags if v else {}
        rows.append({"name": m.name, "best version": v.version if v else None,
                     "versions": len(client.search_model_versions(f"name = '{m.name}'")),
                     "val ppl": float(tags["val_perplexity"]) if "val_perplexity" in tags
                     else None,
                     "test ppl": float(tags["test_perplexity"]) if tags else None,
                     "params": int(tags["params_total"]) if tags else None,
                     "tokens": int(tags["tokens"]) if tags else None,
                     "trial": tags.get("trial_id"), "experiment": tags.get("experiment")})
    return rows


def evaluate_version(version, tracking_uri: str, data_dir, batch_size: int = 8,
                     ) -> tuple[float, float]:
    """Load the registered model of ``version``, recompute its test perplexity on the test
    split of the corpus its tags name, in the dtype it was trained in.

    Returns ``(recomputed, registered)`` test perplexities.
    """
    mlflow.set_tracking_uri(tracking_uri)  # models:/ URIs resolve through the global client
    model = mlflow.pytorch.load_model(f"models:/{version.name}/{version.version}",
                                      map_location="cpu")
    corpus = prepare_corpus(CorpusConfig.model_validate_json(version.tags["data"]), data_dir)
    dataset = corpus.dataset("test", int(version.tags["context_length"]))
    model.eval()
    nll, n = sequence_nll(model, dataset, range(len(dataset)), batch_size, torch.device("cpu"))
    return math.exp(nll / n), float(version.tags["test_perplexity"])
