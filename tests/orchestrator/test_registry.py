"""The model registry on a real MLflow store (SQLite, and an ``mlflow server``): trained models
as MLflow 3 logged models of their runs, one version per run registered from its logged model,
``best`` on validation and ``latest``, a card, incomplete versions deleted, packages downloaded
and loaded again with the predictions they were saved with, here and in a fresh venv that has
only their requirements."""

import json
import math
import os
import re
import subprocess
import venv
import zipfile

import mlflow
import pandas as pd
import pytest
import torch
from mlflow import MlflowClient
from mlflow.entities import LoggedModelStatus
from mlflow.models import Model

from orchestrator.planning.plan import plan
from orchestrator.planning.spec import parse_spec
from orchestrator.records import model_registry, tracking
from tests.orchestrator.conftest import ROOT
from tests.workloads.lm.test_serving import TEXT, tokenizer_json, trained_like  # noqa: F401
from tests.workloads.runtime.test_metrics import MlflowServer
from workloads.core import logged_model
from workloads.core.architecture import CEM_BEST
from workloads.core.registry import get_workload
from workloads.lm.package import load_decoder
from workloads.lm.serving import save_pyfunc
from workloads.lm.workload import package_dir

SPEC = {"name": "reg", "data": {"source": "shakespeare", "vocab_size": 320}, "sizes": ["nano"],
        "variants": {"llama": {}}, "learning_rates": [0.002, 0.004, 0.008],
        "budget": {"tokens": 4096}, "training": {"batch_size": 8}}


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the SQLite store keeps artifacts under ./mlruns
    # Not ./mlflow.db, MLflow's default store: what resolves through MLflow's global client
    # instead of this one finds nothing there.
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    return uri, MlflowClient(uri)


LM = get_workload("language_model")


def log_model(model, tokenizer_file, client, run_id, step=0):
    """The model as a trial keeps it (``RaySession.keep_model``): a pyfunc package, the logged
    model of its run."""
    return logged_model.log_model(client, run_id,
                                  lambda path: save_pyfunc(model, str(tokenizer_file), path), step)


def trial_runs(uri, client, tokenizer_file, name="reg", with_model=True, variant=None):
    """One run per trial of a 3-LR grid (of ``variant``'s model, a variant named ``cem``;
    else Llama's), each with a logged model (unless not ``with_model``); returns the trials and
    their run ids."""
    spec = parse_spec({**SPEC, "name": name,
                       **({"variants": {"cem": variant}} if variant else {})})
    trials = plan(spec)
    exp_id = tracking.experiment_id(client, spec.name)
    parent = tracking.start_parent_run(client, exp_id, spec, "")
    runs = {}
    for i, t in enumerate(trials):
        runs[t.trial_id] = tracking.start_trial_run(client, exp_id, parent, t, "data", {})
        if with_model:
            log_model(trained_like(t.model, seed=i), tokenizer_file, client, runs[t.trial_id],
                      t.steps)
    return trials, runs


def assert_same_predictions(model_uri: str, saved: str) -> None:
    """The pyfunc at ``model_uri`` scores two texts and samples a continuation of one as the
    pyfunc saved at ``saved`` does."""
    a, b = mlflow.pyfunc.load_model(model_uri), mlflow.pyfunc.load_model(saved)
    texts = pd.DataFrame({"text": [TEXT, "To be"]})
    pd.testing.assert_frame_equal(a.predict(texts), b.predict(texts))
    params = {"task": "generate", "max_new_tokens": 8, "seed": 3}
    pd.testing.assert_frame_equal(a.predict(texts, params=params),
                                  b.predict(texts, params=params))


def assert_registered_from_its_logged_model(client, version, run_id, step, tmp_path):
    """``version`` was registered from the one logged model of run ``run_id``: found in the
    run's experiment (its Models view) with the run as source, an output of the run at
    ``step``, its MLmodel naming it, listing the version, no file of it a pickle; returns the
    logged model and the version's files, downloaded under ``tmp_path``."""
    experiment = client.get_run(run_id).info.experiment_id
    (model,) = client.search_logged_models([experiment],
                                           filter_string=f"source_run_id = '{run_id}'")
    assert model.name == "model" and model.status == LoggedModelStatus.READY
    assert model.params["trial_id"] == version.tags["trial_id"]  # the run's params
    assert version.source == f"models:/{model.model_id}" and version.run_id == run_id
    assert model_registry.model_id_of(version) == model.model_id
    assert json.loads(model.tags["mlflow.modelVersions"]) == [
        {"name": version.name, "version": int(version.version)}]
    outputs = client.get_run(run_id).outputs.model_outputs
    assert [(o.model_id, o.step) for o in outputs] == [(model.model_id, step)]
    files = model_registry.download_model(version, client.tracking_uri,
                                          tmp_path / f"v{version.version}")
    mlmodel = Model.load(str(files))
    assert (mlmodel.model_id, mlmodel.run_id) == (model.model_id, run_id)
    for path in files.rglob("*"):  # no pickle, no torch zip (which pickles)
        if path.is_file():
            assert path.read_bytes()[:1] != b"\x80" and not zipfile.is_zipfile(path), path
    return model, files


def test_registering_keeps_one_version_per_run_best_on_validation_and_latest(
        store, tokenizer_json, tmp_path, monkeypatch):  # noqa: F811
    uri, client = store
    trials, runs = trial_runs(uri, client, tokenizer_json)
    # Validation picks the second trial; the first has the best test perplexity (ignored).
    results = {t.trial_id: (runs[t.trial_id], val, test)
               for t, val, test in zip(trials, [30.0, 20.0, 25.0], [10.0, 21.0, 24.0],
                                       strict=True)}
    (line,) = model_registry.register_best(client, "reg", LM, trials, results)
    assert "version 1" in line and "@best -> version 1" in line
    v1 = client.get_model_version_by_alias("cemlab-llama-nano", "best")
    assert v1.run_id == runs[trials[1].trial_id] and v1.aliases == ["best"]
    assert str(model_registry.resolve(client, "cemlab-llama-nano@latest").version) == "1"
    assert v1.tags["val_perplexity"] == "20.0" and v1.tags["trial_id"] == trials[1].trial_id
    model, files = assert_registered_from_its_logged_model(client, v1, v1.run_id,
                                                           trials[1].steps, tmp_path)
    assert model.model_id in line
    assert client.list_artifacts(v1.run_id) == []  # the model is the logged model's, not the run's
    text = (files / "README.md").read_text()
    for needle in (trials[1].trial_id, "| learning rate | 0.004", "| seed | 0 |",
                   "| validation perplexity | 20.0000", "| test perplexity | 21.0000",
                   f"{trials[1].params['total']:,} total", "FLOPs", "git commit", "shakespeare"):
        assert needle in text, needle
    # A resubmission registers nothing.
    assert model_registry.register_best(client, "reg", LM, trials, results) == []
    assert len(client.search_model_versions("name = 'cemlab-llama-nano'")) == 1

    # Another experiment's best is worse on validation: it becomes latest, not best.
    trials2, runs2 = trial_runs(uri, client, tokenizer_json, name="reg2")
    results2 = {t.trial_id: (runs2[t.trial_id], 40.0 + i, 40.0) for i, t in enumerate(trials2)}
    (line,) = model_registry.register_best(client, "reg2", LM, trials2, results2)
    assert "version 2" in line and "@best -> version 1" in line
    assert str(model_registry.resolve(client, "cemlab-llama-nano@latest").version) == "2"
    assert str(model_registry.resolve(client, "cemlab-llama-nano/latest").version) == "2"
    assert str(client.get_model_version_by_alias("cemlab-llama-nano", "best").version) == "1"
    (row,) = model_registry.list_rows(client)
    assert (str(row["best"]), row["versions"], row["size"], row["val ppl"], row["test ppl"]) == (
        "1", 2, "nano", 20.0, 21.0)
    assert row["tokens"] == trials[1].tokens and row["registered (UTC)"].startswith("20")

    # The registered package is the model that run logged, bit for bit, and the pyfunc predicts
    # what the same model saved as a local pyfunc does.
    package = package_dir(model_registry.download_model(v1, uri, tmp_path / "dl"))
    expected = trained_like(trials[1].model, seed=1)
    loaded = load_decoder(package)
    assert all(torch.equal(a, b) for a, b in zip(expected.state_dict().values(),
                                                 loaded.state_dict().values(), strict=True))
    save_pyfunc(expected, str(tokenizer_json), tmp_path / "local")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # what models:/ URIs resolve through
    assert_same_predictions("models:/cemlab-llama-nano@best", str(tmp_path / "local"))


def test_a_run_without_a_whole_model_is_not_registered(store, tokenizer_json):  # noqa: F811
    uri, client = store
    trials, runs = trial_runs(uri, client, tokenizer_json, with_model=False)
    results = {t.trial_id: (runs[t.trial_id], 10.0 + i, 10.0) for i, t in enumerate(trials)}
    (line,) = model_registry.register_best(client, "reg", LM, trials, results)
    assert re.fullmatch(r"not registered: run \w+ kept no model \(missing MLmodel, "
                        r"artifacts/package/model.safetensors, .*\)", line), line
    assert client.search_model_versions("name = 'cemlab-llama-nano'") == []
    with pytest.raises(LookupError, match="no such registered model version"):
        model_registry.resolve(client, "cemlab-llama-nano@best")


def test_a_version_whose_logged_model_lacks_a_file_is_deleted_not_left_half_made(
        store, tokenizer_json):  # noqa: F811
    uri, client = store
    trials, runs = trial_runs(uri, client, tokenizer_json, with_model=False)
    model = trained_like(trials[0].model)

    def without_weights(path):
        save_pyfunc(model, str(tokenizer_json), path)
        (package_dir(path) / "model.safetensors").unlink()

    for t in trials:
        logged_model.log_model(client, runs[t.trial_id], without_weights)
    results = {t.trial_id: (runs[t.trial_id], 10.0 + i, 10.0) for i, t in enumerate(trials)}
    (line,) = model_registry.register_best(client, "reg", LM, trials, results)
    assert re.fullmatch(r"not registered: cemlab-llama-nano version 1 of run \w+ was "
                        r"incomplete \(missing artifacts/package/model.safetensors\) and is "
                        r"deleted", line), line
    assert client.search_model_versions("name = 'cemlab-llama-nano'") == []


def test_a_model_kept_among_its_runs_artifacts_is_registered_as_a_logged_model(
        store, tokenizer_json, tmp_path):  # noqa: F811
    """A run whose model is its artifact ``model`` (kept before logged models): registering it
    copies that model into a logged model of the run, and registers that."""
    uri, client = store
    trials, runs = trial_runs(uri, client, tokenizer_json, with_model=False)
    model = trained_like(trials[2].model, seed=2)
    save_pyfunc(model, str(tokenizer_json), tmp_path / "kept")
    client.log_artifacts(runs[trials[2].trial_id], str(tmp_path / "kept"), "model")
    results = {trials[2].trial_id: (runs[trials[2].trial_id], 12.0, 12.0)}
    (line,) = model_registry.register_best(client, "reg", LM, trials, results)
    assert line.startswith("registered cemlab-llama-nano version 1"), line
    version = model_registry.resolve(client, "cemlab-llama-nano@best")
    _, files = assert_registered_from_its_logged_model(client, version, runs[trials[2].trial_id],
                                                       trials[2].steps, tmp_path)
    loaded = load_decoder(package_dir(files))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 loaded.state_dict().values(), strict=True))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    srv.start()
    yield srv
    srv.stop()


@pytest.mark.slow  # a real MLflow server
def test_through_a_tracking_server_the_worker_needs_its_uri_alone(
        server, tokenizer_json, tmp_path):  # noqa: F811
    """What a Ray Train worker does (``logged_model.log_model`` with a client of the tracking
    URI, the files proxied by the server) and registration through the same server."""
    client = MlflowClient(server.uri)
    trials, runs = trial_runs(server.uri, client, tokenizer_json)
    results = {t.trial_id: (runs[t.trial_id], 30.0 - i, 30.0) for i, t in enumerate(trials)}
    (line,) = model_registry.register_best(client, "reg", LM, trials, results)
    assert line.startswith("registered cemlab-llama-nano version 1"), line
    version = model_registry.resolve(client, "cemlab-llama-nano@best")
    model, files = assert_registered_from_its_logged_model(
        client, version, runs[trials[2].trial_id], trials[2].steps, tmp_path)
    assert model.artifact_location.startswith("mlflow-artifacts:/")  # proxied by the server
    assert model.model_id in {p.name for p in (server.home / "artifacts").rglob("m-*")}
    save_pyfunc(trained_like(trials[2].model, seed=2), str(tokenizer_json), tmp_path / "local")
    assert_same_predictions(str(files), str(tmp_path / "local"))


FRESH_VENV = """
import json, sys
import mlflow.pyfunc, pandas as pd
model = mlflow.pyfunc.load_model("models:/cemlab-cem-nano@best")
scores = model.predict(pd.DataFrame({"text": sys.argv[1:]}))
sample = model.predict(pd.DataFrame({"text": ["To be, or not"]}),
                       params={"task": "generate", "max_new_tokens": 16, "seed": 0})
print("RESULT " + json.dumps({"scores": scores.to_dict("list"),
                              "sample": sample["continuation"][0],
                              "code": sys.modules["workloads.lm.serving"].__file__}))
"""


@pytest.mark.slow  # pip installs the model's requirements into a new venv
def test_a_registered_model_loads_in_a_fresh_venv_with_only_its_requirements(
        server, tokenizer_json, tmp_path):  # noqa: F811
    """``mlflow.pyfunc.load_model`` of a CEM model (T = 2, shared diagonal, preconditioners),
    registered through the tracking server as a trial's is, where no CEM Lab is installed or
    checked out: the venv has the model's pinned requirements only, and the model scores as it
    does here."""
    client = MlflowClient(server.uri)
    trials, runs = trial_runs(server.uri, client, tokenizer_json, name="fresh", variant=CEM_BEST)
    results = {t.trial_id: (runs[t.trial_id], 30.0 - i, 30.0) for i, t in enumerate(trials)}
    (line,) = model_registry.register_best(client, "fresh", LM, trials, results)
    assert line.startswith("registered cemlab-cem-nano version 1"), line
    version = model_registry.resolve(client, "cemlab-cem-nano@best")
    requirements = model_registry.download_model(version, server.uri,
                                                 tmp_path / "model") / "requirements.txt"
    venv.create(tmp_path / "venv", with_pip=True)
    python = tmp_path / "venv" / "bin" / "python"
    # --no-compile: the bytecode of every installed file (torch's thousands) is not what this
    # tests; the modules the model imports compile as they load.
    install = subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-compile",
                              "--disable-pip-version-check", "-r", requirements],
                             capture_output=True, text=True, timeout=900)
    assert install.returncode == 0, install.stderr[-3000:]
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    texts = [TEXT, "Now is the winter"]
    proc = subprocess.run([python, "-c", FRESH_VENV, *texts], cwd=tmp_path, text=True,
                          env={**clean, "MLFLOW_TRACKING_URI": server.uri},
                          capture_output=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    print(f"fresh venv ({requirements.read_text().split()}): {out}")
    assert not out["code"].startswith(str(ROOT))  # the model's own copy of the code
    here = mlflow.pyfunc.load_model(str(tmp_path / "model")).predict(pd.DataFrame({"text": texts}))
    assert out["scores"]["token_count"] == here["token_count"].tolist()
    assert out["scores"]["nll"] == pytest.approx(here["nll"].tolist(), rel=1e-5)
    assert out["scores"]["perplexity"] == pytest.approx(
        [math.exp(n / c) for n, c in zip(out["scores"]["nll"], out["scores"]["token_count"],
                                         strict=True)])
    assert isinstance(out["sample"], str) and out["sample"]


@pytest.mark.parametrize("value", ["0", "-3", "many"])
def test_the_probe_refuses_a_bad_sequence_count_in_one_line(value, capsys):
    from orchestrator.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["models", "probe", "cemlab-cem-nano@best", "--sequences", value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("cemlab models probe: error: argument --sequences")
