"""The model registry on a real MLflow store (SQLite): one version per run, ``best`` on
validation and ``latest``, a card, incomplete versions deleted, packages downloaded again."""

import re

import pytest
import torch
from mlflow import MlflowClient

from orchestrator import model_registry, tracking
from orchestrator.plan import plan
from orchestrator.spec import parse_spec
from tests.workloads.lm.test_serving import tokenizer_json, trained_like  # noqa: F401
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
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    return uri, MlflowClient(uri)


LM = get_workload("language_model")


def log_model(model, tokenizer_file, client, run_id, tmp_path):
    """The model as a trial keeps it: a pyfunc package, artifact ``model`` of its run."""
    path = tmp_path / f"model-{run_id}"
    save_pyfunc(model, str(tokenizer_file), path)
    client.log_artifacts(run_id, str(path), "model")


def trial_runs(uri, client, tokenizer_file, name="reg", with_model=True):
    """One run per trial of a 3-LR grid, each holding a logged package (unless not
    ``with_model``); returns the trials and their run ids."""
    spec = parse_spec({**SPEC, "name": name})
    trials = plan(spec)
    exp_id = tracking.experiment_id(client, spec.name)
    parent = tracking.start_parent_run(client, exp_id, spec, "")
    runs = {}
    for i, t in enumerate(trials):
        runs[t.trial_id] = tracking.start_trial_run(client, exp_id, parent, t, "data", {})
        if with_model:
            log_model(trained_like(t.model, seed=i), tokenizer_file, client, runs[t.trial_id],
                      tokenizer_file.parent)
    return trials, runs


def test_registering_keeps_one_version_per_run_best_on_validation_and_latest(
        store, tokenizer_json, tmp_path):  # noqa: F811
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
    card = client.download_artifacts(v1.run_id, "model/README.md", str(tmp_path))
    text = open(card).read()
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

    # The registered package is the model that run logged, bit for bit.
    package = package_dir(model_registry.download_model(v1, uri, tmp_path / "dl"))
    expected = trained_like(trials[1].model, seed=1)
    loaded = load_decoder(package)
    assert all(torch.equal(a, b) for a, b in zip(expected.state_dict().values(),
                                                 loaded.state_dict().values(), strict=True))


def test_a_version_without_its_package_is_deleted_not_left_half_made(store, tokenizer_json):  # noqa: F811
    uri, client = store
    trials, runs = trial_runs(uri, client, tokenizer_json, with_model=False)
    results = {t.trial_id: (runs[t.trial_id], 10.0 + i, 10.0) for i, t in enumerate(trials)}
    (line,) = model_registry.register_best(client, "reg", LM, trials, results)
    assert re.fullmatch(r"not registered: cemlab-llama-nano version 1 of run \w+ was "
                        r"incomplete \(missing MLmodel, artifacts/package/model.safetensors, "
                        r".*\) and is deleted", line), line
    assert client.search_model_versions("name = 'cemlab-llama-nano'") == []
    with pytest.raises(LookupError, match="no such registered model version"):
        model_registry.resolve(client, "cemlab-llama-nano@best")


@pytest.mark.parametrize("value", ["0", "-3", "many"])
def test_the_probe_refuses_a_bad_sequence_count_in_one_line(value, capsys):
    from orchestrator.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["models", "probe", "cemlab-cem-nano@best", "--sequences", value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("cemlab models probe: error: argument --sequences")
