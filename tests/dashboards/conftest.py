"""A real MLflow store and ledger (SQLite) seeded once per session by ``dashboards.page_bench``:
three paper ``-cpu`` specs (each with a failed and a running trial) and the four-size scaling
spec whose numbers follow a known power law; and a tiny study trained into one store, exported
as a result bundle and imported into another store that has no MLflow run of it."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from mlflow import MlflowClient

from dashboards.page_bench import Seeded, seed_experiment, seed_store
from orchestrator.planning.spec import ExperimentSpec, parse_spec
from orchestrator.records import bundles
from orchestrator.records.ledger import Ledger
from workloads.core.trial import Trial

SPECS = ("fig2a-cpu", "fig3a-cpu", "gp-table-cpu")


@dataclass(frozen=True)
class Store:
    uri: str  # MLflow tracking URI and ledger URL (one SQLite file)
    seeded: Seeded


@pytest.fixture(scope="session")
def seeded_store(tmp_path_factory) -> Store:
    uri = f"sqlite:///{tmp_path_factory.mktemp('seeded') / 'mlflow.db'}"
    return Store(uri, seed_store(uri, uri, paper_specs=SPECS, history=10))


def study_spec() -> ExperimentSpec:
    """A tiny fig2a twin: Llama and CEM attention (trained at T = 2, evaluated at T = 1, 2, 4)
    at three sizes, one learning rate, two seeds: 12 trials."""
    return parse_spec({
        "name": "fig2a-cpu", "data": {"source": "shakespeare", "vocab_size": 512},
        "sizes": ["nano", "tiny", "micro"],
        "variants": {"llama": {}, "cem-attn": {"attention": "cem", "attn_steps": 2}},
        "learning_rates": [0.008], "seeds": [0, 1],
        "budget": {"tokens_per_param": 20, "budget_scale": 0.05},
        "training": {"eval_steps": [1, 2, 4]}})


@dataclass(frozen=True)
class Study:
    trained: str  # the MLflow tracking URI and ledger URL (one SQLite file) that trained it
    bundle: Path  # its result bundle (``cemlab export``)
    served: str  # a fresh store (MLflow and ledger) into which the bundle was imported
    trials: list[Trial]  # as planned


@pytest.fixture(scope="session")
def imported_study(tmp_path_factory) -> Study:
    """``study_spec`` written by ``page_bench.seed_experiment`` (as ``cemlab run`` writes its
    runs and rows) into one store, exported with its MLflow runs, and imported into a fresh
    one, whose MLflow has no run of it."""
    where = tmp_path_factory.mktemp("imported-study")
    MlflowClient(f"sqlite:///{where / 'empty.db'}").search_experiments()  # its tables, once
    for name in ("trained.db", "served.db"):
        shutil.copy(where / "empty.db", where / name)
    trained, served = (f"sqlite:///{where / name}" for name in ("trained.db", "served.db"))
    client = MlflowClient(trained)
    ledger = Ledger(trained)
    trials, _, _ = seed_experiment(client, ledger, study_spec(), history=4, unfinished=False)
    bundles.export_bundle(ledger, ["fig2a-cpu"], where / "bundle", client)
    bundles.import_bundle(where / "bundle", Ledger(served))
    return Study(trained, where / "bundle", served, trials)
