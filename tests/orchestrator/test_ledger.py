"""The ledger on SQLite and on PostgreSQL: one row per trial, statuses and timestamps, and its
schema under Alembic (built, adopted, kept apart from MLflow's, opened read-only, raced)."""

import datetime as dt
import logging
import multiprocessing
import re
import threading
import time

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy.exc import IntegrityError, StatementError

from orchestrator.records.ledger import (
    FIRST_REVISION,
    VERSION_TABLE,
    Base,
    Ledger,
    LedgerUnavailable,
    Status,
    TrialRow,
    alembic_config,
    head_revisions,
    include_name,
)
from tests.conftest import postgres_database

COORDS = {"dataset": "shakespeare", "variant": "cem", "size": "micro", "lr": 0.002, "seed": 0}


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'mlflow.db'}"
        return
    with postgres_database() as url:
        yield url


def _tables(url: str) -> set[str]:
    engine = sa.create_engine(url)
    try:
        return set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()


def _query(url: str, sql: str) -> list[tuple]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as c:
            return [tuple(r) for r in c.exec_driver_sql(sql)]
    finally:
        engine.dispose()


def _schema_diff(url: str) -> list:
    """Alembic's differences between the ledger's tables in ``url`` and the ORM metadata."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as c:
            context = MigrationContext.configure(c, opts={"include_name": include_name})
            return compare_metadata(context, Base.metadata)
    finally:
        engine.dispose()


def test_trials_are_recorded_once_with_status_and_timestamps(url):
    ledger = Ledger(url)
    exp = ledger.ensure_experiment("fig3a-cpu", "language_model", "name: fig3a-cpu\n")
    assert ledger.ensure_experiment("fig3a-cpu", "language_model", "edited\n").id == exp.id
    row = ledger.ensure_trial(exp.id, "abc123", **COORDS)
    assert row.status is Status.PENDING and row.mlflow_run_id is None
    assert ledger.ensure_trial(exp.id, "abc123", **COORDS).id == row.id  # no second row
    ledger.update_trial(row.id, mlflow_run_id="run1", status="RUNNING",  # a value, or a member
                        checkpoint_path="/ckpt/trial-abc123")
    again = Ledger(url)  # another process sees the same ledger
    (seen,) = again.trials(again.experiment("fig3a-cpu").id)
    assert (seen.status, seen.mlflow_run_id) == (Status.RUNNING, "run1")
    assert type(seen.status) is Status  # read back from the database as a member
    assert seen.started_at is not None and seen.finished_at is None
    done = again.update_trial(row.id, status=Status.FINISHED, metric=171.5, val_metric=170.0)
    assert done.finished_at >= done.started_at and (done.metric, done.val_metric) == (171.5, 170.0)
    assert again.experiment("fig3a-cpu").spec_yaml == "edited\n"
    assert _query(url, "SELECT status FROM cemlab_trials") == [("FINISHED",)]  # stored as text
    with pytest.raises(ValueError, match="status must be one of PENDING, RUNNING, FINISHED"):
        again.update_trial(row.id, status="DONE")
    with pytest.raises(ValueError, match="got 'finished'"):  # values are upper case
        again.update_trial(row.id, status="finished")
    with pytest.raises(StatementError), again.session() as s:  # nor by writing the row directly
        s.get(TrialRow, row.id).status = "DONE"
    assert again.trials(exp.id)[0].status is Status.FINISHED
    with pytest.raises(IntegrityError), again.session() as s:  # the hash is unique per experiment
        s.add(TrialRow(experiment_id=exp.id, trial_hash="abc123", **COORDS))
    assert len(again.trials(exp.id)) == 1
    assert list(Status) == ["PENDING", "RUNNING", "FINISHED", "FAILED"]


def test_the_migrated_schema_is_the_orm_schema(url):
    Ledger(url)
    assert _tables(url) == {"cemlab_experiments", "cemlab_trials", VERSION_TABLE}
    assert _query(url, f"SELECT version_num FROM {VERSION_TABLE}") == [
        (rev,) for rev in head_revisions()]
    assert _schema_diff(url) == []
    engine = sa.create_engine(url)  # the comparison does see the ledger's tables
    with engine.begin() as c:
        c.exec_driver_sql("CREATE INDEX ix_probe ON cemlab_trials (seed)")
    engine.dispose()
    assert [d[0] for d in _schema_diff(url)] == ["remove_index"]


def test_a_ledger_made_by_create_all_is_adopted_with_its_rows(url):
    from alembic import command

    engine = sa.create_engine(url)
    with engine.begin() as c:  # the schema create_all made before the migrations: 0001's
        command.upgrade(alembic_config(c), FIRST_REVISION)
        c.exec_driver_sql(f"DROP TABLE {VERSION_TABLE}")
        c.exec_driver_sql("INSERT INTO cemlab_experiments (name, workload, spec_yaml, "
                          "created_at, updated_at) VALUES ('old', 'gp_regression', 'x: 1', "
                          "'2025-01-02 03:04:05', '2025-01-02 03:04:05')")
        c.exec_driver_sql("INSERT INTO cemlab_trials (experiment_id, trial_hash, dataset, "
                          "variant, size, lr, seed, status, created_at, updated_at) SELECT id, "
                          "'h1', 'd', 'v', 's', 0.01, 3, 'FINISHED', created_at, updated_at "
                          "FROM cemlab_experiments")
    engine.dispose()
    reader = Ledger(url, migrate=False)  # a read-only ledger reads it as it is
    assert [e.name for e in reader.experiments()] == ["old"]
    assert VERSION_TABLE not in _tables(url)
    ledger = Ledger(url)
    (exp,) = ledger.experiments()
    assert (exp.name, exp.spec_yaml) == ("old", "x: 1")
    (trial,) = ledger.trials(exp.id)
    assert (trial.trial_hash, trial.seed, trial.status) == ("h1", 3, Status.FINISHED)
    assert _query(url, f"SELECT version_num FROM {VERSION_TABLE}") == [
        (rev,) for rev in head_revisions()]
    assert _schema_diff(url) == []
    ledger.ensure_trial(exp.id, "h2", **COORDS)  # and it goes on working
    assert [t.trial_hash for t in Ledger(url).trials(exp.id)] == ["h1", "h2"]


def test_ledger_shares_the_mlflow_database(tmp_path):
    from mlflow import MlflowClient

    url = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(url).create_experiment("shared")  # MLflow creates its schema first
    mlflow_tables = _tables(url)
    (mlflow_revision,) = _query(url, "SELECT version_num FROM alembic_version")
    Ledger(url).ensure_experiment("shared", "language_model", "")
    assert _tables(url) == mlflow_tables | {"cemlab_experiments", "cemlab_trials",
                                            VERSION_TABLE}
    assert _query(url, "SELECT version_num FROM alembic_version") == [mlflow_revision]
    assert _query(url, f"SELECT version_num FROM {VERSION_TABLE}") == [
        (rev,) for rev in head_revisions()]
    assert _schema_diff(url) == []  # MLflow's tables are not the ledger's business
    client = MlflowClient(url)  # a fresh client checks MLflow's schema revision
    experiment = client.get_experiment_by_name("shared")
    run = client.create_run(experiment.experiment_id)
    client.log_metric(run.info.run_id, "loss", 0.5)
    assert client.get_run(run.info.run_id).data.metrics == {"loss": 0.5}
    assert Ledger(url).experiment("shared") is not None


def test_a_read_only_ledger_creates_nothing(url, tmp_path):
    reader = Ledger(url, migrate=False)
    assert (reader.experiments(), reader.experiment("x"), reader.trials(1)) == ([], None, [])
    if url.startswith("sqlite"):
        assert not (tmp_path / "mlflow.db").exists()  # not even an empty database file
    assert _tables(url) == set()
    writer = Ledger(url)
    exp = writer.ensure_experiment("x", "language_model", "")
    writer.ensure_trial(exp.id, "h", **COORDS)
    assert [e.name for e in reader.experiments()] == ["x"]  # sees them once they exist
    assert [t.status for t in reader.trials(exp.id)] == [Status.PENDING]


def _open_ledger(url: str, barrier, name: str) -> None:
    barrier.wait()
    Ledger(url).ensure_experiment(name, "language_model", "")


def test_processes_opening_a_fresh_ledger_at_once_all_succeed(url):
    ctx = multiprocessing.get_context("fork")  # spawn re-runs __main__ (AppTest swaps it)
    barrier = ctx.Barrier(4)
    procs = [ctx.Process(target=_open_ledger, args=(url, barrier, f"e{i}")) for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    assert sorted(e.name for e in Ledger(url).experiments()) == ["e0", "e1", "e2", "e3"]
    assert _query(url, f"SELECT version_num FROM {VERSION_TABLE}") == [
        (rev,) for rev in head_revisions()]


def test_a_lease_is_held_renewed_released_and_taken_over_after_expiry(url):
    ledger = Ledger(url)
    exp = ledger.ensure_experiment("leases", "language_model", "")
    row = ledger.ensure_trial(exp.id, "abc123", **COORDS)
    first = ledger.acquire(row.id, "host-a:1:aa", lease_s=60)
    assert first.acquired and first.owner == "host-a:1:aa" and first.previous_owner is None
    assert first.status is Status.PENDING
    other = ledger.acquire(row.id, "host-b:2:bb", lease_s=60)  # a live lease is not taken
    assert not other.acquired and (other.owner, other.expires_at) == (first.owner,
                                                                     first.expires_at)
    assert ledger.acquire(row.id, "host-a:1:aa", lease_s=60).acquired  # its owner renews
    assert ledger.renew("host-a:1:aa", lease_s=0.3) == 1  # the heartbeat sets the expiry
    (seen,) = ledger.trials(exp.id)
    assert seen.heartbeat_at <= seen.lease_expires_at <= seen.heartbeat_at + dt.timedelta(
        seconds=0.3)
    time.sleep(0.4)  # the owner died: its lease lapses and the other takes it over
    taken = ledger.acquire(row.id, "host-b:2:bb", lease_s=60)
    assert taken.acquired and taken.previous_owner == "host-a:1:aa"
    assert ledger.renew("host-a:1:aa", lease_s=60) == 0  # the dead owner holds nothing now
    done = ledger.update_trial(row.id, status=Status.FINISHED, metric=1.0)
    assert (done.lease_owner, done.lease_expires_at) == (None, None)  # settled: released
    finished = ledger.acquire(row.id, "host-c:3:cc", lease_s=60)
    assert not finished.acquired and finished.status is Status.FINISHED
    second = ledger.ensure_trial(exp.id, "def456", **COORDS)
    assert ledger.acquire(second.id, "host-c:3:cc", lease_s=60).acquired
    assert ledger.release("host-c:3:cc") == 1 and ledger.trials(exp.id)[1].lease_owner is None


def test_only_the_lease_holder_records_a_trial(url):
    """A driver whose lease lapsed and was taken over can neither settle the trial nor release
    the new holder's lease; the holder's records land, and a retried settle lands again."""
    ledger = Ledger(url)
    exp = ledger.ensure_experiment("owned", "language_model", "")
    row = ledger.ensure_trial(exp.id, "abc123", **COORDS)
    assert ledger.acquire(row.id, "host-a:1:aa", lease_s=0.3).acquired
    assert ledger.update_trial(row.id, owner="host-b:2:bb", status=Status.FAILED) is None
    running = ledger.update_trial(row.id, owner="host-a:1:aa", status=Status.RUNNING)
    assert running.status is Status.RUNNING and running.lease_owner == "host-a:1:aa"
    time.sleep(0.4)  # a's lease lapses, but nobody took it: a still settles its own trial
    other = ledger.ensure_trial(exp.id, "def456", **COORDS)
    assert ledger.acquire(other.id, "host-a:1:aa", lease_s=0.3).acquired
    time.sleep(0.4)
    failed = ledger.update_trial(other.id, owner="host-a:1:aa", status=Status.FAILED,
                                 error="boom")
    assert (failed.status, failed.error, failed.lease_owner) == (Status.FAILED, "boom", None)

    assert ledger.acquire(row.id, "host-b:2:bb", lease_s=60).previous_owner == "host-a:1:aa"
    late = ledger.update_trial(row.id, owner="host-a:1:aa", status=Status.FAILED, error="late")
    assert late is None  # the old driver's late failure changes nothing
    (seen, _) = ledger.trials(exp.id)
    assert (seen.status, seen.error, seen.lease_owner) == (Status.RUNNING, None, "host-b:2:bb")
    done = ledger.update_trial(row.id, owner="host-b:2:bb", status=Status.FINISHED, metric=2.0)
    assert (done.status, done.metric, done.lease_owner) == (Status.FINISHED, 2.0, None)
    again = ledger.update_trial(row.id, owner="host-b:2:bb", status=Status.FINISHED, metric=2.0)
    assert again is not None and again.status is Status.FINISHED  # a retry finds it done
    assert ledger.update_trial(row.id, owner="host-a:1:aa", status=Status.FAILED) is None
    assert ledger.trials(exp.id)[0].status is Status.FINISHED


def test_a_parent_run_is_set_once(url):
    ledger = Ledger(url)
    exp = ledger.ensure_experiment("parent", "language_model", "")
    assert ledger.set_parent_run(exp.id, "run-a") == "run-a"
    assert ledger.set_parent_run(exp.id, "run-b") == "run-a"  # the loser learns the winner
    assert ledger.experiment("parent").parent_run_id == "run-a"


def _race_for_a_trial(url: str, barrier, owner: str, results, experiment: str) -> None:
    ledger = Ledger(url)
    exp = ledger.ensure_experiment(experiment, "language_model", "")
    barrier.wait()
    row = ledger.ensure_trial(exp.id, "abc123", **COORDS)
    results.put((owner, row.id, ledger.acquire(row.id, owner, lease_s=60).acquired))


def _race(url: str, experiments: list[str]) -> list[tuple[str, int, bool]]:
    """One process per experiment of ``experiments`` claims trial abc123 of it, all at once:
    ``(owner, row id, acquired)`` of each."""
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(len(experiments)), ctx.Queue()
    procs = [ctx.Process(target=_race_for_a_trial, args=(url, barrier, f"p{i}", results, name))
             for i, name in enumerate(experiments)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * len(procs)
    return [results.get(timeout=5) for _ in procs]


def test_of_processes_claiming_one_trial_at_once_exactly_one_gets_it(url):
    Ledger(url).ensure_experiment("race", "language_model", "")
    outcomes = _race(url, ["race"] * 6)
    assert len({row_id for _, row_id, _ in outcomes}) == 1  # one row for the trial
    winners = [owner for owner, _, acquired in outcomes if acquired]
    assert len(winners) == 1
    (row,) = Ledger(url).trials(Ledger(url).experiment("race").id)
    assert row.lease_owner == winners[0]


def test_of_experiments_claiming_one_trial_id_at_once_exactly_one_gets_it(url):
    """The trial cache's lease: one trial id in six experiments, claimed at once by six
    processes, each for its own experiment's row."""
    outcomes = _race(url, [f"experiment-{i}" for i in range(6)])
    assert len({row_id for _, row_id, _ in outcomes}) == 6  # a row per experiment
    assert len([owner for owner, _, acquired in outcomes if acquired]) == 1


def test_a_lease_covers_the_trial_id_across_experiments_and_the_trained_row_is_found(url):
    ledger = Ledger(url)
    a, b = (ledger.ensure_experiment(name, "language_model", "") for name in ("a", "b"))
    row_a, row_b = (ledger.ensure_trial(e.id, "abc123", **COORDS) for e in (a, b))
    assert ledger.acquire(row_a.id, "host-a:1:aa", lease_s=60).acquired
    held = ledger.acquire(row_b.id, "host-b:2:bb", lease_s=60)
    assert not held.acquired and held.owner == "host-a:1:aa"  # a's lease holds b's row too
    assert ledger.finished_copy("abc123", b.id) is None
    assert ledger.finished_hashes({"abc123", "other"}) == set()
    ledger.update_trial(row_a.id, owner="host-a:1:aa", status=Status.FINISHED, metric=1.5)
    assert ledger.finished_hashes({"abc123", "other"}) == {"abc123"}
    assert ledger.finished_copy("abc123", b.id).id == row_a.id
    assert ledger.finished_copy("abc123", a.id) is None  # never its own experiment's row
    assert ledger.acquire(row_b.id, "host-b:2:bb", lease_s=60).acquired
    ledger.update_trial(row_b.id, owner="host-b:2:bb", status=Status.FINISHED,
                        source_trial_id=row_a.id)
    c = ledger.ensure_experiment("c", "language_model", "")
    assert ledger.finished_copy("abc123", c.id).id == row_a.id  # the trained one, not a copy
    assert {r.experiment_id for r in ledger.rows_of_trials({"abc123"})} == {a.id, b.id}


def test_a_ledger_call_rides_out_a_database_outage_then_fails_in_one_line_past_its_deadline(
        private_postgres, caplog):
    ledger = Ledger(private_postgres.url, retry_deadline_s=120)
    exp = ledger.ensure_experiment("outage", "language_model", "")
    row = ledger.ensure_trial(exp.id, "abc123", **COORDS)
    private_postgres.stop()  # the database goes away for 3 s in the middle of a grid
    threading.Timer(3.0, private_postgres.start).start()
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="orchestrator.records.ledger"):
        done = ledger.update_trial(row.id, status=Status.FINISHED, metric=171.5)
    assert 3.0 <= time.monotonic() - started < 60
    assert "retrying update_trial" in caplog.text
    (seen,) = Ledger(private_postgres.url).trials(exp.id)  # written once, after the outage
    assert (done.metric, seen.status, seen.metric) == (171.5, Status.FINISHED, 171.5)

    private_postgres.stop()  # and now it stays away
    ledger.retry_deadline_s = 2.0
    started = time.monotonic()
    with pytest.raises(LedgerUnavailable) as failure:
        ledger.trials(exp.id)
    assert 1.0 <= time.monotonic() - started < 10
    message = str(failure.value)
    assert "\n" not in message and re.match(
        r"ledger database postgresql\+psycopg2://postgres@127\.0\.0\.1:\d+/postgres did not "
        r"answer for \d s \(trials\): .*", message), message


def test_a_refused_database_name_is_not_retried(private_postgres):
    started = time.monotonic()
    with pytest.raises(sa.exc.OperationalError, match="does not exist"):
        Ledger(private_postgres.url.rsplit("/", 1)[0] + "/no_such_db")
    assert time.monotonic() - started < 10
