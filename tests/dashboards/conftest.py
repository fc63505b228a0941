"""A real MLflow store and ledger (SQLite) seeded once per session by ``dashboards.page_bench``:
three paper ``-cpu`` specs (each with a failed and a running trial) and the four-size scaling
spec whose numbers follow a known power law."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from dashboards.page_bench import Seeded, seed_store

SPECS = ("fig2a-cpu", "fig3a-cpu", "gp-table-cpu")


@dataclass(frozen=True)
class Store:
    uri: str  # MLflow tracking URI and ledger URL (one SQLite file)
    seeded: Seeded


@pytest.fixture(scope="session")
def seeded_store(tmp_path_factory) -> Store:
    uri = f"sqlite:///{tmp_path_factory.mktemp('seeded') / 'mlflow.db'}"
    return Store(uri, seed_store(uri, uri, paper_specs=SPECS, history=10))
