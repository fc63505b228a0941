"""The MLflow model registry: the best trial per (variant, size), and using it again.

Registered models are named ``cemlab-<variant>-<size>``. Each experiment registers, once, its best
finished trial per (variant, size), chosen on validation perplexity (never on test): the run's
``model`` artifact (the language model's: a ``workloads.lm.serving`` pyfunc, safetensors weights,
config, tokenizer, code) plus the workload's model card. What a registered model must hold, and what
evaluating, probing or exporting one means, is its workload's (``Workload``). Alias ``best`` names
the version with the lowest validation perplexity; ``latest`` (MLflow's built-in
``models:/NAME/latest``, ``NAME@latest`` here) is the newest; tags record the trial hash, validation
and test perplexity, parameters, tokens, data config and experiment.
"""

from __future__ import annotations

import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import mlflow
from mlflow import MlflowClient
from mlflow.entities.model_registry.model_version_status import ModelVersionStatus
from mlflow.exceptions import MlflowException

from orchestrator.tracking import CODE_TAG, COMMIT_TAG
from workloads.core.registry import get_workload
from workloads.core.trial import Trial
from workloads.core.workload import Workload

ALIAS = "best"
LATEST = "latest"  # MLflow's own: ``models:/NAME/latest`` is the newest version (not an alias)
CARD = "README.md"  # the model card, in the run's ``model`` directory
WORKLOAD_TAG = "workload"  # of a version: whose model it is (none: the language model's)
READY_TIMEOUT_S = 60.0


class RegistrationError(RuntimeError):
    """A model version could not be made whole; it was deleted."""


def model_name(variant: str, size: str) -> str:
    return f"cemlab-{variant}-{size}"


def register_best(client: MlflowClient, experiment: str, workload: Workload, trials: list[Trial],
                  results: dict[str, tuple[str, float, float]]) -> list[str]:
    """Register the best finished trial of every (variant, size), by validation perplexity,
    unless its run is registered already (a resubmission registers nothing), so that it is the
    ``latest``; point ``best`` at the version with the lowest validation perplexity.

    ``results`` maps trial ids to ``(mlflow run id, validation perplexity, test perplexity)``.
    Returns one line per registration: ``registered NAME version N ...``, or ``not registered:
    ...`` for a version whose files were incomplete (it is deleted; the others go on).
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
        if _versions(client, name, run_id):
            continue
        if not client.search_registered_models(f"name = '{name}'"):
            try:
                client.create_registered_model(name, description=f"Best {variant} at size "
                                               f"{size} by validation perplexity (CEM Lab)")
            except MlflowException as e:  # a concurrent submission registered it first
                if e.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
        run = client.get_run(run_id)
        client.log_text(run_id, workload.model_card(name, experiment, t, val, test,
                                                    run.data.tags.get(COMMIT_TAG),
                                                    run.data.tags.get(CODE_TAG)),
                        f"model/{CARD}")
        tags = {WORKLOAD_TAG: workload.name, "trial_id": t.trial_id, "val_perplexity": repr(val),
                "test_perplexity": repr(test), "experiment": experiment,
                "variant": variant, "size": size, "lr": repr(t.lr), "seed": str(t.seed),
                "params_total": str(t.params["total"]),
                "params_non_embedding": str(t.params["non_embedding"]),
                "tokens": str(t.tokens), "data": t.config.model_dump_json(),
                "context_length": str(t.model.context_length)}
        client.create_model_version(name, f"runs:/{run_id}/model", run_id=run_id, tags=tags)
        version = _first_version_of_run(client, name, run_id)
        try:
            _check_whole(client, version, (CARD, *workload.model_files))
        except RegistrationError as e:
            done.append(f"not registered: {e}")
            continue
        best_version = _set_best(client, name)
        done.append(f"registered {name} version {version.version} ({t.label}, validation "
                    f"perplexity {val:.2f}, test {test:.2f}): @{LATEST}; @{ALIAS} -> version "
                    f"{best_version}")
    return done


def _versions(client: MlflowClient, name: str, run_id: str) -> list:
    return client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'")


def _check_whole(client: MlflowClient, version, required: tuple[str, ...]) -> None:
    """Wait for ``version`` to be READY and check that its source holds every file of
    ``required``; else delete it and raise ``RegistrationError``."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while (status := ModelVersionStatus.from_string(version.status)) == (
            ModelVersionStatus.PENDING_REGISTRATION) and time.monotonic() < deadline:
        time.sleep(0.5)
        version = client.get_model_version(version.name, version.version)
    present = set()
    for folder in ("", *{str(Path(f).parent) for f in required if "/" in f}):
        path = f"model/{folder}".rstrip("/")
        present |= {a.path.removeprefix("model/") for a in client.list_artifacts(
            version.run_id, path) if not a.is_dir}
    missing = [f for f in required if f not in present]
    if status == ModelVersionStatus.READY and not missing:
        return
    client.delete_model_version(version.name, version.version)
    why = f"missing {', '.join(missing)}" if missing else f"status {version.status}"
    raise RegistrationError(f"{version.name} version {version.version} of run "
                            f"{version.run_id} was incomplete ({why}) and is deleted")


def _set_best(client: MlflowClient, name: str) -> str:
    """Point alias ``best`` at the version of ``name`` with the lowest validation perplexity
    (the oldest of equals); return its version number."""
    versions = client.search_model_versions(f"name = '{name}'")
    best = min(versions, key=lambda v: (float(v.tags.get("val_perplexity", "inf")),
                                        int(v.version)))
    client.set_registered_model_alias(name, ALIAS, best.version)
    return best.version


def _first_version_of_run(client: MlflowClient, name: str, run_id: str):
    """The oldest version of model ``name`` made from run ``run_id``, after deleting the later
    ones: two submissions that registered the same run at once both keep the oldest."""
    first, *later = sorted(_versions(client, name, run_id), key=lambda v: int(v.version))
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
    """The model version ``NAME@ALIAS``, ``NAME/VERSION`` or ``NAME`` (its ``best``);
    ``NAME@latest`` and ``NAME/latest`` are the newest version, as in MLflow's URIs.

    Raises:
        LookupError: no such model, alias or version (one line).
    """
    name, _, alias = ref.partition("@")
    name, _, version = name.partition("/")
    try:
        if LATEST in (alias, version):
            versions = client.search_model_versions(f"name = '{name}'")
            if not versions:
                raise MlflowException(f"registered model {name!r} has no version")
            return client.get_model_version(name, str(max(int(v.version) for v in versions)))
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
        rows.append({"name": m.name, "best": v.version if v else None,
                     "versions": len(client.search_model_versions(f"name = '{m.name}'")),
                     "size": tags.get("size"), "params": _number(tags, "params_total", int),
                     "tokens": _number(tags, "tokens", int),
                     "val ppl": _number(tags, "val_perplexity"),
                     "test ppl": _number(tags, "test_perplexity"),
                     "registered (UTC)": datetime.fromtimestamp(
                         v.creation_timestamp / 1000, UTC).strftime("%Y-%m-%d %H:%M")
                     if v else None,
                     "experiment": tags.get("experiment")})
    return rows


def _number(tags: dict[str, str], key: str, kind: type = float) -> float | int | None:
    return kind(tags[key]) if key in tags else None


def workload_of(version) -> Workload:
    """The workload whose model ``version`` is (its ``workload`` tag; the language model's
    where the version has none)."""
    return get_workload(version.tags.get(WORKLOAD_TAG, "language_model"))


def download_model(version, tracking_uri: str, directory: str | Path) -> Path:
    """Download the model of ``version`` (its run's ``model`` directory) into ``directory``;
    returns where it is.

    Raises:
        LookupError: it lacks a file its workload's models hold (``Workload.model_files``),
            e.g. a version registered before packages (a pickle), which is never loaded.
    """
    mlflow.set_tracking_uri(tracking_uri)  # models:/ URIs resolve through the global client
    local = Path(mlflow.artifacts.download_artifacts(
        f"models:/{version.name}/{version.version}", dst_path=str(directory)))
    missing = [f for f in workload_of(version).model_files if not (local / f).is_file()]
    if missing:
        raise LookupError(f"{version.name} version {version.version} lacks {', '.join(missing)}"
                          " (registered by an older CEM Lab, as a pickle, which is never "
                          "loaded): run its experiment again to register one")
    return local


def probe_version(version, tracking_uri: str, data_dir, split: str = "validation",
                  sequences: int = 16) -> list[dict]:
    """The workload's probe (``Workload.probe_model``) of ``version`` on ``sequences`` evenly
    spaced sequences of ``split``."""
    with tempfile.TemporaryDirectory() as tmp:
        return workload_of(version).probe_model(download_model(version, tracking_uri, tmp),
                                                version.tags, Path(data_dir), split, sequences)


def evaluate_version(client: MlflowClient, version, tracking_uri: str, data_dir,
                     split: str = "test", batch_size: int = 8,
                     recursion: dict[str, float] | None = None) -> tuple[float, float | None]:
    """Recompute the test metric of ``version`` on ``split`` of the data its tags name
    (``Workload.evaluate_model``), and store it on the version (tag
    ``<split>_perplexity_recomputed``). With ``recursion`` (``attn_steps``, ``mlp_steps``,
    ``step_size_scale``: test-time recursion), evaluate it at those steps instead, stored under
    ``<split>_perplexity_<recursion_tag>``.

    Returns ``(recomputed, registered)``; registered is None where the version records none
    for ``split``, and with ``recursion``.
    """
    with tempfile.TemporaryDirectory() as tmp:
        recomputed = workload_of(version).evaluate_model(
            download_model(version, tracking_uri, tmp), version.tags, Path(data_dir), split,
            batch_size, recursion)
    suffix = recursion_tag(recursion) if recursion else "recomputed"
    client.set_model_version_tag(version.name, version.version,
                                 f"{split}_perplexity_{suffix}", repr(recomputed))
    key = {"test": "test_perplexity", "validation": "val_perplexity"}.get(split)
    if recursion or key not in version.tags:
        return recomputed, None
    return recomputed, float(version.tags[key])


def recursion_tag(recursion: dict[str, float]) -> str:
    """``attn4_mlp4_eta0.5`` for ``{"attn_steps": 4, "mlp_steps": 4, "step_size_scale": 0.5}``
    (``-`` where a count is as trained)."""
    return (f"attn{recursion.get('attn_steps') or '-'}_mlp{recursion.get('mlp_steps') or '-'}"
            f"_eta{recursion.get('step_size_scale', 1.0):g}")


def export_version(version, tracking_uri: str, directory: str | Path) -> Path:
    """The workload's export (``Workload.export_model``) of ``version`` into ``directory``;
    returns what to load."""
    with tempfile.TemporaryDirectory() as tmp:
        return workload_of(version).export_model(download_model(version, tracking_uri, tmp),
                                                 Path(directory))
