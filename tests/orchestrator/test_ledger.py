"""The ledger on SQLite and on PostgreSQL: one row per trial, statuses and timestamps."""

import uuid

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from orchestrator.ledger import Ledger, TrialRow

PG_SERVER = "postgresql+psycopg2://postgres@127.0.0.1:5432"


def _postgres_url():
    """A fresh database on the local PostgreSQL server, or a skip reason."""
    try:
        admin = sa.create_engine(f"{PG_SERVER}/postgres", isolation_level="AUTOCOMMIT",
                                 connect_args={"connect_timeout": 3})
        name = f"cemlab_test_{uuid.uuid4().hex[:8]}"
        with admin.connect() as c:
            c.execute(sa.text(f"CREATE DATABASE {name}"))
    except sa.exc.OperationalError as e:
        pytest.skip(f"no PostgreSQL server at 127.0.0.1:5432 ({str(e).splitlines()[0]})")
    return admin, name


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'mlflow.db'}"
        return
    admin, name = _postgres_url()
    yield f"{PG_SERVER}/{name}"
    with admin.connect() as c:
        c.execute(sa.text(f"DROP DATABASE {name} WITH (FORCE)"))


def test_trials_are_recorded_once_with_status_and_timestamps(url):
    ledger = Ledger(url)
    exp = ledger.ensure_experiment("fig3a-cpu", "language_model", "name: fig3a-cpu\n")
    assert ledger.ensure_experiment("fig3a-cpu", "language_model", "edited\n").id == exp.id
    coords = {"dataset": "shakespeare", "variant": "cem", "size": "micro", "lr": 0.002,
              "seed": 0}
    row = ledger.ensure_trial(exp.id, "abc123", **coords)
    assert row.status == "PENDING" and row.mlflow_run_id is None
    assert ledger.ensure_trial(exp.id, "abc123", **coords).id == row.id  # no second row
    ledger.update_trial(row.id, mlflow_run_id="run1", status="RUNNING",
                        checkpoint_path="/ckpt/trial-abc123")
    again = Ledger(url)  # another process sees the same ledger
    (seen,) = again.trials(again.experiment("fig3a-cpu").id)
    assert (seen.status, seen.mlflow_run_id) == ("RUNNING", "run1")
    assert seen.started_at is not None and seen.finished_at is None
    done = again.update_trial(row.id, status="FINISHED", metric=171.5)
    assert done.finished_at >= done.started_at and done.metric == 171.5
    assert again.experiment("fig3a-cpu").spec_yaml == "edited\n"
    with pytest.raises(ValueError, match="status must be one of"):
        again.update_trial(row.id, status="DONE")
    with pytest.raises(IntegrityError), again.session() as s:  # the hash is unique per experiment
        s.add(TrialRow(experiment_id=exp.id, trial_hash="abc123", **coords))
    assert len(again.trials(exp.id)) == 1


def test_ledger_shares_the_mlflow_database(tmp_path):
    from mlflow import MlflowClient

    url = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(url).create_experiment("shared")  # MLflow creates its schema first
    Ledger(url).ensure_experiment("shared", "language_model", "")
    tables = set(sa.inspect(sa.create_engine(url)).get_table_names())
    assert {"experiments", "runs", "cemlab_experiments", "cemlab_trials"} <= tables
    assert MlflowClient(url).get_experiment_by_name("shared") is not None


def test_results_read_the_newest_row_per_grid_point(tmp_path):
    from orchestrator.results import experiment_rows
    from orchestrator.spec import parse_spec

    spec = parse_spec({"name": "edited", "sizes": ["nano"], "variants": {"llama": {}},
                       "learning_rates": [0.002, 0.004]})
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    exp = ledger.ensure_experiment("edited", "language_model", "")
    point = {"dataset": "shakespeare", "variant": "llama", "size": "nano", "seed": 0}
    old = ledger.ensure_trial(exp.id, "old", lr=0.002, **point)
    new = ledger.ensure_trial(exp.id, "new", lr=0.002, **point)  # same point, edited science
    other = ledger.ensure_trial(exp.id, "other", lr=0.004, **point)
    ledger.ensure_trial(exp.id, "off-grid", lr=0.008, **point)
    assert [r.id for r in experiment_rows(spec, ledger)] == [new.id, other.id]
    assert [r.id for r in experiment_rows(spec, ledger, {"old"})] == [old.id]
