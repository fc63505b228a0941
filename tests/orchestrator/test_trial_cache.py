"""The trial cache: a trial that another experiment of the ledger finished is copied, not trained
again (its row points to the trained one, its MLflow run copies the metrics and names the source
run); ``plan`` marks it; ``--no-cache`` trains it; one live lease per trial id across
experiments. Real ledger and MLflow stores (SQLite), the toy workload, no Ray."""

import pytest
from mlflow import MlflowClient

from orchestrator.execution.run import claim, model_runs, open_books
from orchestrator.planning.plan import format_plan, plan
from orchestrator.planning.spec import parse_spec
from orchestrator.records import tracking
from orchestrator.records.ledger import Ledger, Status
from orchestrator.settings import Settings
from tests.orchestrator.test_workload_interface import SPEC, toy  # noqa: F401 (fixture)
from workloads.core.trial import Prepared

PREPARED = Prepared(None, {"toy_floor": 0.0}, "")


@pytest.fixture
def settings(tmp_path, monkeypatch):
    monkeypatch.setenv("CEMLAB_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    return Settings()


def _spec(name, lrs):
    return parse_spec({**SPEC, "name": name, "learning_rates": lrs, "seeds": [0]})


def _train(books, task, val, test, losses):
    """What a trial's workers and driver record: the run's history and time, then FINISHED."""
    run_id = task.job.run_id
    for step, loss in enumerate(losses, start=1):
        books.client.log_metric(run_id, "loss", loss, step=step)
    books.client.log_metric(run_id, "time/train_s", 12.5)
    books.client.log_metric(run_id, "time/total_s", 14.0)
    books.ledger.update_trial(task.row_id, status=Status.FINISHED, metric=test, val_metric=val,
                              checkpoint_path="/ckpt/a")
    tracking.mirror_status(books.client, run_id, Status.FINISHED)


def test_a_trial_finished_in_another_experiment_is_copied_not_trained(toy, settings):  # noqa: F811
    spec_a, spec_b = _spec("toy-a", [0.01, 0.05]), _spec("toy-b", [0.05, 0.1])
    trials_a, trials_b = plan(spec_a), plan(spec_b)
    shared = trials_a[1].trial_id
    assert trials_b[0].trial_id == shared  # the id is the science, not the experiment

    books_a = open_books(spec_a, "", settings)
    tasks_a, held = claim(spec_a, trials_a, PREPARED, books_a, "owner-a")
    assert len(tasks_a) == 2 and held == []
    source_task = next(t for t in tasks_a if t.job.trial.trial_id == shared)
    _train(books_a, source_task, val=0.5, test=0.6, losses=[3.0, 2.0, 1.0])

    cached = books_a.ledger.finished_hashes({t.trial_id for t in trials_b})
    assert cached == {shared}
    table = format_plan(spec_b, trials_b, {t.trial_id: 60.0 for t in trials_b}, 1, cached)
    row_of = {line.split()[1]: line for line in table.splitlines() if line.split()[:1] in
              (["0"], ["1"])}
    assert row_of[shared].rstrip().endswith("cached")
    assert not row_of[trials_b[1].trial_id].rstrip().endswith("cached")
    assert "est. wall 60s (1 trial(s) at once)" in table  # the cached trial takes no time
    assert "cached: 1 of 2 trial(s) finished in the ledger already" in table

    books_b = open_books(spec_b, "", settings)
    tasks_b, held = claim(spec_b, trials_b, PREPARED, books_b, "owner-b")
    assert [t.job.trial.trial_id for t in tasks_b] == [trials_b[1].trial_id] and held == []
    rows_b = {r.trial_hash: r for r in books_b.ledger.trials(books_b.experiment_row_id)}
    (row_a,) = [r for r in books_a.ledger.trials(books_a.experiment_row_id)
                if r.trial_hash == shared]
    copy = rows_b[shared]
    assert (copy.status, copy.metric, copy.val_metric, copy.checkpoint_path,
            copy.source_trial_id) == (Status.FINISHED, 0.6, 0.5, "/ckpt/a", row_a.id)
    assert copy.lease_owner is None and copy.mlflow_run_id != row_a.mlflow_run_id

    client = MlflowClient(settings.tracking_uri)
    run = client.get_run(copy.mlflow_run_id)
    assert run.info.experiment_id == books_b.mlflow_experiment_id
    assert run.info.status == "FINISHED"
    assert run.data.tags[tracking.CACHED_FROM_TAG] == row_a.mlflow_run_id
    assert run.data.tags[tracking.PARENT_TAG] == books_b.parent_run_id
    assert run.data.tags[tracking.TRIAL_TAG] == shared
    assert run.data.params == client.get_run(row_a.mlflow_run_id).data.params
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")] == [
        (1, 3.0), (2, 2.0), (3, 1.0)]
    assert "time/train_s" not in run.data.metrics  # its time is counted where it trained
    assert run.data.metrics["time/total_s"] == 0.0

    # claimed again, it is finished: no second copy; the other is held by owner-b's live lease
    again, held = claim(spec_b, trials_b, PREPARED, books_b, "owner-b2")
    assert again == [] and [t.trial_id for t in held] == [trials_b[1].trial_id]
    runs_b = client.search_runs([books_b.mlflow_experiment_id],
                                f"tags.`{tracking.TRIAL_TAG}` = '{shared}'")
    assert len(runs_b) == 1
    # the registry takes its model from the run that trained it, where the model is
    assert model_runs(books_b.ledger.trials(books_b.experiment_row_id), books_b.ledger) == {
        shared: (row_a.mlflow_run_id, 0.5, 0.6)}


def test_no_cache_trains_it_again_and_a_live_lease_elsewhere_holds_it(toy, settings):  # noqa: F811
    spec_a, spec_c = _spec("toy-a", [0.01, 0.05]), _spec("toy-c", [0.01, 0.05])
    trials_a, trials_c = plan(spec_a), plan(spec_c)
    books_a = open_books(spec_a, "", settings)
    tasks_a, _ = claim(spec_a, trials_a, PREPARED, books_a, "owner-a")
    _train(books_a, tasks_a[1], val=0.5, test=0.6, losses=[1.0])
    # trials_a[0] stays under owner-a's live lease: experiment c waits for it, trains the other
    books_c = open_books(spec_c, "", settings)
    tasks_c, held = claim(spec_c, trials_c, PREPARED, books_c, "owner-c", cache=False)
    assert [t.trial_id for t in held] == [trials_a[0].trial_id]
    assert [t.job.trial.trial_id for t in tasks_c] == [trials_a[1].trial_id]
    assert all(r.source_trial_id is None
               for r in books_c.ledger.trials(books_c.experiment_row_id))


def test_plan_reads_the_embedded_ledger_only_where_it_exists(tmp_path, monkeypatch):
    for name in ("MLFLOW_TRACKING_URI", "CEMLAB_LEDGER_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CEMLAB_HOME", str(tmp_path / "home"))
    assert Settings().existing_ledger_url() is None and not (tmp_path / "home").exists()
    url = Settings().ledger_url
    assert Settings().existing_ledger_url() is None  # its directory is not the store
    Ledger(url)  # a run creates the embedded store
    assert Settings().existing_ledger_url() == url == f"sqlite:///{tmp_path}/home/mlflow.db"
