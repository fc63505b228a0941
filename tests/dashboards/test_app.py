"""The Streamlit dashboard against a real MLflow store (SQLite), with Streamlit's AppTest."""

import itertools
import math
from pathlib import Path

import pytest
from mlflow import MlflowClient
from mlflow.entities import Metric
from streamlit.testing.v1 import AppTest

from dashboards.plots import energy_descent, family, lr_sweep, perplexity_vs_parameters
from dashboards.reads import energy_frame, optima_frame, runs_frame, trial_statuses
from orchestrator.ledger import Ledger, Status

APP = str(Path(__file__).resolve().parents[2] / "dashboards" / "app.py")
RUNS = {  # variant: (attention, mlp, params_total, test_perplexity)
    "llama": ("llama", "llama", 1_901_696, 150.0),
    "cem-attn": ("cem", "llama", 1_770_632, 155.0),
    "cem-mlp": ("llama", "cem", 1_705_088, 160.0),
    "cem": ("cem", "cem", 1_574_024, 158.0),
}


@pytest.fixture
def store(tmp_path, monkeypatch) -> MlflowClient:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("CEMLAB_LEDGER_URL", uri)  # the ledger shares MLflow's database
    return MlflowClient(uri)


def fill(client: MlflowClient, lrs=(0.002,)) -> None:
    """An experiment ``demo`` in MLflow, and in the ledger with every trial FINISHED except
    ``cem-mlp`` (RUNNING in the ledger although its MLflow run says FINISHED)."""
    ledger = Ledger(client.tracking_uri)
    ledger_exp = ledger.ensure_experiment("demo", "language_model", "")
    exp = client.create_experiment("demo")
    parent = client.create_run(exp, run_name="demo", tags={"cemlab.role": "experiment"})
    client.log_batch(parent.info.run_id, metrics=[
        Metric("shakespeare/cem/micro/opt_lr", 0.003, 0, 0),
        Metric("shakespeare/cem/micro/opt_perplexity", 150.0, 0, 0)])
    for (variant, (attention, mlp, params, ppl)), lr in itertools.product(RUNS.items(), lrs):
        ppl = ppl * (1 + (math.log2(lr) - math.log2(0.003)) ** 2 / 10)
        run = client.create_run(exp, run_name=f"{variant}@micro lr={lr}", tags={
            "variant": variant, "size": "micro", "attention": attention, "mlp": mlp,
            "lr": str(lr), "seed": "0", "cemlab.role": "trial",
            "mlflow.parentRunId": parent.info.run_id})
        metrics = [Metric("params_total", params, 0, 0), Metric("test_perplexity", ppl, 0, 50),
                   Metric("unigram_test_perplexity", 594.5, 0, 0)]
        metrics += [Metric("loss", 7 - math.log(s), 0, s) for s in range(1, 51)]
        metrics += [Metric("val_perplexity", ppl * 1.1, 0, 25),
                    Metric("val_perplexity", ppl, 0, 50)]
        if attention == "cem":  # energy diagnostics of a T = 2 run
            metrics += [Metric(f"energy/{sub}/layer{layer}/step{t}", -t - layer, 0, 50)
                        for sub in ("attn", "mlp") for layer in range(2) for t in range(3)]
        client.log_batch(run.info.run_id, metrics=metrics)
        client.set_terminated(run.info.run_id)
        row = ledger.ensure_trial(ledger_exp.id, f"{variant}-{lr}", dataset="shakespeare",
                                  variant=variant, size="micro", lr=lr, seed=0)
        ledger.update_trial(row.id, mlflow_run_id=run.info.run_id, status=(
            Status.RUNNING if variant == "cem-mlp" else Status.FINISHED))


def test_dashboard_shows_runs_and_perplexity_vs_parameters(store):
    fill(store)
    at = AppTest.from_file(APP, default_timeout=60).run()
    assert not at.exception
    assert at.sidebar.selectbox[0].value == "demo"
    table = at.dataframe[0].value  # the trial runs, not the experiment's parent run
    assert sorted(table["variant"]) == sorted(RUNS)
    # Status is the ledger's, not MLflow's: cem-mlp is RUNNING there.
    assert dict(zip(table["variant"], table["status"])) == {
        v: "RUNNING" if v == "cem-mlp" else "FINISHED" for v in RUNS}
    assert dict(zip(table["variant"], table["test_perplexity"])) == pytest.approx({
        v: r[3] * (1 + (math.log2(0.002) - math.log2(0.003)) ** 2 / 10)
        for v, r in RUNS.items()})
    charts = at.get("plotly_chart")
    # perplexity vs parameters, loss curves, validation curves, energy descent
    assert len(charts) == 4
    assert "594.5" in at.caption[0].value
    assert sorted(at.main.selectbox[0].options) == ["cem-attn@micro lr=0.002",
                                                    "cem@micro lr=0.002"]


def test_lr_sweep_shows_every_curve_and_the_akima_optima(store):
    fill(store, lrs=(0.001, 0.002, 0.004))
    at = AppTest.from_file(APP, default_timeout=60).run()
    assert not at.exception
    assert len(at.get("plotly_chart")) == 5  # the sweep joins the four charts
    runs = runs_frame(store, "demo", trial_statuses("demo"))
    optima = optima_frame(store, "demo")
    assert len(runs) == 12 and sorted(runs["lr"].unique()) == [0.001, 0.002, 0.004]
    assert optima.to_dict("records") == [{"dataset": "shakespeare", "variant": "cem",
                                          "size": "micro", "opt_lr": 0.003,
                                          "opt_perplexity": 150.0}]
    fig = lr_sweep(runs, optima)
    curves = [t for t in fig.data if t.mode == "lines+markers"]
    assert len(curves) == 4 and all(list(t.x) == [0.001, 0.002, 0.004] for t in curves)
    (star,) = [t for t in fig.data if t.name == "optimum cem@micro"]
    assert (list(star.x), list(star.y)) == ([0.003], [150.0])


def test_dashboard_without_runs_says_how_to_get_some(store):
    at = AppTest.from_file(APP, default_timeout=60).run()
    assert not at.exception
    assert "make demo" in at.info[0].value


def test_the_dashboard_never_writes_the_ledger(store):
    store.create_experiment("only-in-mlflow")  # MLflow's tables, no ledger tables yet
    assert trial_statuses("only-in-mlflow") == {}
    import sqlalchemy as sa

    tables = sa.inspect(sa.create_engine(store.tracking_uri)).get_table_names()
    assert not [t for t in tables if t.startswith("cemlab")]


def test_energy_descent_has_a_line_per_layer_and_sublayer(store):
    fill(store)
    run = next(r for r in store.search_runs([store.get_experiment_by_name("demo").experiment_id])
               if r.info.run_name == "cem@micro lr=0.002")
    frame = energy_frame(store, run.info.run_id)
    assert len(frame) == 2 * 2 * 3
    assert frame[(frame.sublayer == "attn") & (frame.layer == 1)]["energy"].tolist() == [-1, -2, -3]
    fig = energy_descent(frame)
    assert len(fig.data) == 4  # 2 layers x 2 sublayer facets
    assert all(list(trace.x) == [0, 1, 2] for trace in fig.data)


def test_perplexity_vs_parameters_has_one_trace_per_family():
    import pandas as pd

    frame = pd.DataFrame([{"run_name": v, "size": "micro", "attention": a, "mlp": m,
                           "params_total": p, "test_perplexity": ppl}
                          for v, (a, m, p, ppl) in RUNS.items()]
                         + [{"run_name": "running", "size": "micro", "attention": "cem",
                             "mlp": "cem", "params_total": 1, "test_perplexity": None}])
    fig = perplexity_vs_parameters(frame)
    points = {trace.name.split(",")[0]: (list(trace.x), list(trace.y)) for trace in fig.data}
    assert points == {family(a, m): ([p], [ppl]) for a, m, p, ppl in RUNS.values()}
    assert fig.layout.yaxis.type == "log"
