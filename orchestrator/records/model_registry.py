"""The MLflow model registry: the best trial per (variant, size), and using it again.

Registered models are named ``cemlab-<variant>-<size>``. Each experiment registers, once, its best
finished trial per (variant, size), chosen on validation perplexity (never on test): the logged
model its run kept (``workloads.core.logged_model``; the language model's: a
``workloads.lm.serving`` pyfunc, safetensors weights, config, tokenizer, code) plus the workload's
model card, added to it. A version's source is ``models:/<model_id>`` (``model_id_of``), and the
logged model lists its versions (tag ``mlflow.modelVersions``), as MLflow's UI links them. What a
registered model must hold, and what evaluating, probing or exporting one means, is its workload's
(``Workload``). Alias ``best`` names the version with the lowest validation perplexity; ``latest``
(MLflow's built-in ``models:/NAME/latest``, ``NAME@latest`` here) is the newest; tags record the
trial hash, validation and test perplexity, parameters, tokens, data config and experiment.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

import mlflow
from mlflow import MlflowClient
from mlflow.entities import LoggedModel, LoggedModelStatus
from mlflow.entities.model_registry.model_version_status import ModelVersionStatus
from mlflow.exceptions import MlflowException
from mlflow.utils.mlflow_tags import MLFLOW_MODEL_VERSIONS

from orchestrator.records.tracking import CODE_TAG, COMMIT_TAG
from workloads.core import logged_model
from workloads.core.registry import get_workload
from workloads.core.trial import Trial
from workloads.core.workload import Workload

ALIAS = "best"
LATEST = "latest"  # MLflow's own: ``models:/NAME/latest`` is the newest version (not an alias)
CARD = "README.md"  # the model card, among the logged model's files
WORKLOAD_TAG = "workload"  # of a version: whose model it is (none: the language model's)
READY_TIMEOUT_S = 60.0
TRACKING_URI_VARIABLE = "MLFLOW_TRACKING_URI"


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
    What is registered is the run's logged model (``logged_model.model_of_run``), with the model
    card added; a run that kept its model among its own artifacts (``model/``) gets a logged
    model copied from them first. Returns one line per registration: ``registered NAME version
    N ...``, or ``not registered: ...`` for a run without a whole model, or a version whose
    files were incomplete (it is deleted; the others go on).
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
        try:
            model = _model_of(client, run_id, workload.model_files, t.steps)
        except RegistrationError as e:
            done.append(f"not registered: {e}")
            continue
        if not client.search_registered_models(f"name = '{name}'"):
            try:
                client.create_registered_model(name, description=f"Best {variant} at size "
                                               f"{size} by validation perplexity (CEM Lab)")
            except MlflowException as e:  # a concurrent submission registered it first
                if e.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
        run = client.get_run(run_id)
        with tempfile.TemporaryDirectory() as tmp:
            card = Path(tmp) / CARD
            card.write_text(workload.model_card(name, experiment, t, val, test,
                                                run.data.tags.get(COMMIT_TAG),
                                                run.data.tags.get(CODE_TAG)))
            client.log_model_artifact(model.model_id, str(card))
        tags = {WORKLOAD_TAG: workload.name, "trial_id": t.trial_id, "val_perplexity": repr(val),
                "test_perplexity": repr(test), "experiment": experiment,
                "variant": variant, "size": size, "lr": repr(t.lr), "seed": str(t.seed),
                "params_total": str(t.params["total"]),
                "params_non_embedding": str(t.params["non_embedding"]),
                "tokens": str(t.tokens), "data": t.config.model_dump_json(),
                "context_length": str(t.model.context_length)}
        with _tracking_uri(client.tracking_uri):  # a database store looks models:/ up globally
            client.create_model_version(name, model.model_uri, run_id=run_id, tags=tags,
                                        model_id=model.model_id)
        version = _first_version_of_run(client, name, run_id)
        try:
            _check_whole(client, version, model.model_id, (CARD, *workload.model_files))
        except RegistrationError as e:
            done.append(f"not registered: {e}")
            continue
        _link(client, model.model_id, version)
        best_version = _set_best(client, name)
        done.append(f"registered {name} version {version.version} ({t.label}, validation "
                    f"perplexity {val:.2f}, test {test:.2f}; logged model {model.model_id}): "
                    f"@{LATEST}; @{ALIAS} -> version {best_version}")
    return done


def model_id_of(version) -> str | None:
    """The logged model that ``version`` was registered from: its ``model_id`` where the
    registry keeps one (MLflow's open-source stores return none), else the id its source
    ``models:/<model_id>`` names; None for a version registered from a run's artifacts
    (``runs:/``)."""
    if getattr(version, "model_id", None):
        return version.model_id
    source = version.source or ""
    tail = source.removeprefix("models:/")
    return tail if source.startswith("models:/m-") and "/" not in tail else None


@contextmanager
def _tracking_uri(uri: str) -> Iterator[None]:
    """MLflow's global tracking URI is ``uri`` for the block, and what it was after (set, or
    taken from ``MLFLOW_TRACKING_URI``, or neither): MLflow's database stores resolve
    ``models:/`` URIs through the global client."""
    environment = os.environ.get(TRACKING_URI_VARIABLE)
    before = mlflow.get_tracking_uri() if mlflow.is_tracking_uri_set() else None
    mlflow.set_tracking_uri(uri)  # sets the variable too
    try:
        yield
    finally:
        mlflow.set_tracking_uri(None if before == environment else before)
        if environment is not None:
            os.environ[TRACKING_URI_VARIABLE] = environment


def _versions(client: MlflowClient, name: str, run_id: str) -> list:
    return client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'")


def _model_of(client: MlflowClient, run_id: str, files: tuple[str, ...],
              step: int) -> LoggedModel:
    """The logged model of run ``run_id`` (``logged_model.model_of_run``); for a run that kept
    the model among its own artifacts, under ``model/`` (``files`` all there), a logged model
    copied from them, the run's output at ``step``.

    Raises:
        RegistrationError: the run has neither.
    """
    model = logged_model.model_of_run(client, run_id)
    if model is not None:
        return model
    # The run's own artifacts, by their location: a runs:/ URI would list its logged models too.
    kept = f"{client.get_run(run_id).info.artifact_uri}/{logged_model.NAME}"
    missing = _missing(lambda folder: {
        f"{folder}/{Path(a.path).name}".lstrip("/") for a in mlflow.artifacts.list_artifacts(
            f"{kept}/{folder}".rstrip("/"), tracking_uri=client.tracking_uri) if not a.is_dir},
        files)
    if missing:
        raise RegistrationError(f"run {run_id} kept no model (missing {', '.join(missing)})")
    with tempfile.TemporaryDirectory() as tmp:
        local = mlflow.artifacts.download_artifacts(kept, dst_path=tmp,
                                                    tracking_uri=client.tracking_uri)
        return logged_model.log_model(client, run_id, lambda path: shutil.copytree(local, path),
                                      step)


def _missing(listing: Callable[[str], set[str]], required: tuple[str, ...]) -> list[str]:
    """The files of ``required`` that ``listing(folder)`` (the files in ``folder``, paths
    relative to the model's root; ``""``: the root) does not show, in order."""
    present: set[str] = set()
    for folder in ("", *sorted({str(Path(f).parent) for f in required if "/" in f})):
        present |= listing(folder)
    return [f for f in required if f not in present]


def _check_whole(client: MlflowClient, version, model_id: str,
                 required: tuple[str, ...]) -> None:
    """Wait for ``version`` to be READY and check that its logged model ``model_id`` is READY
    and holds every file of ``required``; else delete the version and raise
    ``RegistrationError``."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while (status := ModelVersionStatus.from_string(version.status)) == (
            ModelVersionStatus.PENDING_REGISTRATION) and time.monotonic() < deadline:
        time.sleep(0.5)
        version = client.get_model_version(version.name, version.version)
    model = client.get_logged_model(model_id)
    missing = _missing(lambda folder: {a.path for a in client.list_logged_model_artifacts(
        model_id, folder or None) if not a.is_dir}, required)
    if (status == ModelVersionStatus.READY and model.status == LoggedModelStatus.READY
            and not missing):
        return
    client.delete_model_version(version.name, version.version)
    if missing:
        why = f"missing {', '.join(missing)}"
    elif status != ModelVersionStatus.READY:
        why = f"status {version.status}"
    else:
        why = f"logged model {model_id} {model.status}"
    raise RegistrationError(f"{version.name} version {version.version} of run "
                            f"{version.run_id} was incomplete ({why}) and is deleted")


def _link(client: MlflowClient, model_id: str, version) -> None:
    """List ``version`` on logged model ``model_id`` (its tag ``mlflow.modelVersions``, which
    MLflow's UI shows), unless it is there already (a tracking server adds it itself)."""
    listed = json.loads(client.get_logged_model(model_id).tags.get(MLFLOW_MODEL_VERSIONS, "[]"))
    if any(v.get("name") == version.name and str(v.get("version")) == str(version.version)
           for v in listed):
        return
    listed.append({"name": version.name, "version": int(version.version)})
    client.set_logged_model_tags(model_id, {MLFLOW_MODEL_VERSIONS: json.dumps(listed)})


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
    """Download the model of ``version`` (its logged model's files; for a version registered
    from a run's artifacts, the run's ``model`` directory) into ``directory``; returns where it
    is.

    Raises:
        LookupError: it lacks a file its workload's models hold (``Workload.model_files``),
            e.g. a version registered before packages (a pickle), which is never loaded.
    """
    with _tracking_uri(tracking_uri):  # models:/ URIs resolve through the global client
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
