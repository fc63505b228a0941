"""MLflow bookkeeping: a parent run per experiment, nested trial runs, found again by hash."""

from pathlib import Path

import pytest
from mlflow import MlflowClient

from orchestrator.planning.plan import plan
from orchestrator.planning.spec import load_spec
from orchestrator.records import tracking
from orchestrator.records.ledger import Status

DEMO = Path(__file__).resolve().parents[2] / "experiments" / "demo-grid.yaml"


def test_trial_runs_nest_under_the_parent_and_are_found_by_trial_id(tmp_path):
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    spec = load_spec(DEMO)
    trial = plan(spec)[1]
    exp_id = tracking.experiment_id(client, spec.name)
    assert tracking.experiment_id(client, spec.name) == exp_id
    parent = tracking.start_parent_run(client, exp_id, spec, DEMO.read_text())
    assert tracking.find_trial_run(client, exp_id, trial.trial_id) is None
    run_id = tracking.start_trial_run(client, exp_id, parent, trial, "data", {"x": 1.0})
    assert tracking.find_trial_run(client, exp_id, trial.trial_id) == run_id
    run = client.get_run(run_id)
    assert run.data.tags["mlflow.parentRunId"] == parent
    assert run.data.params["lr"] == str(trial.lr) and run.data.params["seed"] == "0"
    assert run.data.metrics["params_total"] == trial.params["total"]
    assert client.get_run(parent).data.params["variants"] == "llama,cem-attn,cem-mlp,cem"
    assert run.data.params["data.vocab_size"] == "4096"  # the workload's section, by its key
    assert run.data.params["training.grad_accum"] == str(trial.grad_accum)
    # The run follows every status the ledger gives its trial, and ends with the last.
    for status, mlflow_status in [(Status.PENDING, "SCHEDULED"), (Status.RUNNING, "RUNNING"),
                                  (Status.FAILED, "FAILED"), (Status.RUNNING, "RUNNING"),
                                  (Status.FINISHED, "FINISHED")]:
        tracking.mirror_status(client, run_id, status)
        assert client.get_run(run_id).info.status == mlflow_status
    assert client.get_run(run_id).info.end_time is not None


def test_teardown_is_the_rest_of_the_total_and_never_negative():
    reported = {"time/startup_s": 10.0, "time/train_s": 70.0, "time/eval_s": 5.0,
                "time/checkpoint_s": 3.0, "val_loss": 1.0}
    out = tracking.breakdown(reported, started_at=1000.0, ended_at=1100.0)
    assert out["time/total_s"] == 100.0 and out["time/teardown_s"] == pytest.approx(12.0)
    assert sum(v for k, v in out.items() if k != "time/total_s") == pytest.approx(100.0)
    assert "val_loss" not in out
    assert tracking.breakdown(reported, 1000.0, 1050.0)["time/teardown_s"] == 0.0  # clocks disagree
    timed = tracking.breakdown(reported, 1000.0, 1100.0, queued_at=930.0, submitted_at=900.0)
    assert timed["time/queue_s"] == 70.0  # handed to Tune at 930, to Ray Train at 1000
    assert timed["time/first_step_s"] == 110.0  # submitted at 900, first step at 1000 + 10
    assert {k: timed[k] for k in out} == out  # outside the total and its parts
