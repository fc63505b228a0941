"""Every page of the dashboard with Streamlit's AppTest against a real MLflow store and ledger
(SQLite) seeded by ``dashboards.page_bench`` with numbers that follow a known law, so the figures'
data can be checked against the truth: the fitted power law, the parameter saving, the chosen
learning rates, the training curves, the energies, the registry."""

from __future__ import annotations

import hashlib
import logging
import math
import sqlite3

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

from dashboards import page_bench
from dashboards.page_bench import CEM_SAVING, FAILED_ERROR, TRUE_ALPHA, TRUE_E
from dashboards.page_timing import APP
from tests.conftest import DASHBOARD_STORE

# the session's seeded store takes about half a minute
pytestmark = [pytest.mark.slow, DASHBOARD_STORE]


class _Logged(logging.Handler):
    """The messages of the records it is handed."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def page(monkeypatch, uri: str, script: str, **state) -> AppTest:
    """``script`` run under AppTest on ``uri`` with ``state``; it raised nothing and called no
    deprecated Streamlit API (Streamlit logs those on its own logger, not as Python warnings)."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("CEMLAB_LEDGER_URL", uri)
    at = AppTest.from_file(APP, default_timeout=120)
    for key, value in state.items():
        at.session_state[key] = value
    at.switch_page(f"views/{script}")
    deprecations = _Logged()
    logger = logging.getLogger("streamlit.deprecation_util")
    logger.addHandler(deprecations)
    try:
        at.run()
    finally:
        logger.removeHandler(deprecations)
    assert not at.exception, at.exception[0].message
    assert not deprecations.messages, f"{script}: {deprecations.messages}"
    return at


def test_overview_counts_every_status_and_names_the_failure(seeded_store, monkeypatch):
    at = page(monkeypatch, seeded_store.uri, "overview.py")
    table = at.dataframe[0].value.set_index("experiment")
    seeded = seeded_store.seeded
    for name, trials in seeded.trials.items():
        unfinished = name in seeded.failed
        assert table.loc[name, "trials"] == len(trials)
        assert table.loc[name, "failed"] == table.loc[name, "running"] == int(unfinished)
        assert table.loc[name, "finished"] == len(trials) - 2 * unfinished
        assert table.loc[name, "remaining"] != "-" if unfinished else "0 s"
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["trials failed"] == str(len(seeded.failed))
    failed = at.dataframe[1].value
    assert sorted(failed["trial"]) == sorted(seeded.failed.values())
    assert set(failed["error"]) == {FAILED_ERROR}
    split = at.dataframe[2].value.set_index("experiment")  # every seeded trial: 60 of 75 s
    for name, trials in seeded.trials.items():
        trained = len(trials) - 2 * (name in seeded.failed)
        assert split.loc[name, "trials"] == trained
        assert split.loc[name, "in train steps"] == pytest.approx(0.8)
        assert split.loc[name, "total s"] == pytest.approx(75.0 * trained)
        assert split.loc[name, "first step after submit s"] == 12.0


def test_compare_recovers_the_power_law_and_the_saving(seeded_store, monkeypatch):
    at = page(monkeypatch, seeded_store.uri, "compare.py",
              cmp_exps=["scaling-synthetic"])
    fits = at.dataframe[0].value.set_index("family")
    # the seeded law, noise 0.2 %: alpha and E come back within a few percent, shown to 4
    # significant digits and inside their bounds
    assert not fits.apply(lambda col: col.str.contains("bound")).any().any()
    assert float(fits.loc["Llama", "alpha"]) == pytest.approx(TRUE_ALPHA, rel=0.05)
    assert float(fits.loc["CEM (both)", "alpha"]) == pytest.approx(TRUE_ALPHA, rel=0.05)
    assert float(fits.loc["Llama", "E"]) == pytest.approx(TRUE_E, rel=0.05)
    assert fits.loc["Llama", "E"] == f"{float(fits.loc['Llama', 'E']):.4g}"
    (headline,) = [s.value for s in at.success]
    assert headline.startswith("CEM (both) reaches Llama's perplexity with 25% fewer "
                               "non-embedding parameters (95% CI")
    low, high = (int(v) for v in headline.split("CI ")[1].split("%")[0].split("–"))
    assert low <= CEM_SAVING * 100 <= high
    assert len(at.get("plotly_chart")) == 1


def test_compare_says_when_there_are_too_few_sizes(seeded_store, monkeypatch):
    at = page(monkeypatch, seeded_store.uri, "compare.py", cmp_exps=["fig2a-cpu"],
              cmp_sizes=["pico", "nano"])  # the spec's two sizes
    assert sorted(w.value for w in at.warning) == [  # Llama with ALiBi: a family of its own
        "not enough sizes to fit: CEM attention has 2 sizes, Llama has 2; a power law needs 3",
        "not enough sizes to fit: Llama (ALiBi) has 2 sizes, Llama has 2; a power law needs 3"]
    assert len(at.get("plotly_chart")) == 1  # the points are drawn all the same


def test_lr_sweep_chooses_on_validation_at_the_true_optimum(seeded_store, monkeypatch):
    at = page(monkeypatch, seeded_store.uri, "sweeps.py", sweep_exp="fig3a-cpu")
    table = at.dataframe[0].value
    # the synthetic optimum sits in the middle of the paper's symmetric log2 grid; the 0.2 %
    # noise of each point moves the chosen LR by a few percent (0.04 octave)
    assert set(table["variant"]) == {"llama", "llama-alibi", "cem"}
    assert table["chosen LR (val, mean)"].tolist() == pytest.approx(
        [page_bench.LR_OPT] * len(table), rel=0.05)
    assert not at.warning  # no optimum at a grid edge
    assert len(at.get("plotly_chart")) == 1


def test_training_curves_band_the_seeds(seeded_store, monkeypatch):
    at = page(monkeypatch, seeded_store.uri, "curves.py", curves_exp="scaling-synthetic",
              curves_smooth=0.0, curves_x="tokens")
    assert len(at.get("plotly_chart")) == 2  # loss, validation perplexity
    csv = at.get("download_button")
    assert len(csv) == 2


def test_energy_heatmaps_hold_the_logged_energies(seeded_store, monkeypatch):
    at = page(monkeypatch, seeded_store.uri, "energy_diagnostics.py",
              energy_exp="scaling-synthetic")
    assert len(at.get("plotly_chart")) == 2  # energy, fraction of tokens whose energy fell
    assert "exact" in at.caption[0].value
    from dashboards.reads import diagnostics

    run_id = at.sidebar.selectbox(key="energy_run").value
    energy = diagnostics(seeded_store.uri, run_id)
    assert energy[energy["kind"] == "energy"].apply(
        lambda r: r["value"] == -1.0 - r["step"] / (r["layer"] + 1), axis=1).all()


def test_recursion_page_draws_the_best_cem_runs_at_every_t_eval_as_logged(seeded_store,
                                                                          monkeypatch):
    """Perplexity against T_eval for the best CEM run of each size on validation (the default), both
    step-size rules, each value the seeded law: ``page_bench.recursion_perplexity`` of the run's
    own test perplexity (T_train 1: kept at T=1 is the run as trained)."""
    at = page(monkeypatch, seeded_store.uri, "recursion.py", recursion_exp="scaling-synthetic")
    assert len(at.get("plotly_chart")) == 1
    table = at.dataframe[0].value
    cem = {t.label: t for t in seeded_store.seeded.trials["scaling-synthetic"]
           if t.variant == "cem"}
    assert len(table) == len({t.size for t in cem.values()}) == 4  # one run of each size
    assert list(table.columns) == [f"{rule} T={t}" for rule in ("kept", "scaled")
                                   for t in page_bench.EVAL_STEPS]
    for label, row in table.iterrows():
        trial = cem[label]
        test = row["kept T=1"]  # T_train = 1, eta as trained: the run's test perplexity
        for rule in ("kept", "scaled"):
            for t in page_bench.EVAL_STEPS:
                assert row[f"{rule} T={t}"] == pytest.approx(
                    page_bench.recursion_perplexity(trial, test, t, rule), rel=1e-12)
        assert row["kept T=8"] == pytest.approx(test * 1.15) and (
            row["scaled T=8"] == pytest.approx(test * 1.075))


def test_registry_lists_versions_aliases_and_the_eval(seeded_store, monkeypatch):
    at = page(monkeypatch, seeded_store.uri, "model_registry.py")
    versions = at.dataframe[0].value
    trials = seeded_store.seeded.trials["scaling-synthetic"]
    assert len(versions) == len({(t.variant, t.size) for t in trials})
    assert set(versions["aliases"]) == {"best"}
    evals = versions["eval: test perplexity"].dropna()
    assert len(evals) == 1
    row = versions.loc[evals.index[0]]
    assert evals.iloc[0] == pytest.approx(row["test perplexity"], rel=1e-4)


def test_paper_figures_draw_seeded_specs_and_say_how_to_run_the_others(seeded_store,
                                                                     monkeypatch):
    at = page(monkeypatch, seeded_store.uri, "paper.py")
    infos = " ".join(i.value for i in at.info)
    # fig2b was not seeded: its tab names both specs and the submit command
    assert "ray job submit --working-dir . -- cemlab run " \
           "experiments/paper/fig2b-cpu.yaml" in infos
    assert len(at.get("plotly_chart")) >= 3  # fig2a, fig3a (optima + sweep)
    # the paper's "about half the attention parameters" beside ours, from our parameter counts
    beside = at.dataframe[0].value
    ratio = beside[beside["quantity"] == "attn_param_ratio"].iloc[0]
    assert ratio["paper"] == 0.5 and ratio["ours"] == pytest.approx(0.5, abs=0.02)


def _dump(path: str) -> str:
    with sqlite3.connect(path) as db:
        return hashlib.sha256("\n".join(db.iterdump()).encode()).hexdigest()


def test_no_page_writes_to_mlflow_or_the_ledger(seeded_store, monkeypatch):
    path = seeded_store.uri.removeprefix("sqlite:///")
    before = _dump(path)
    for script in ("overview.py", "compare.py", "paper.py", "sweeps.py", "curves.py",
                   "energy_diagnostics.py", "recursion.py", "model_registry.py"):
        page(monkeypatch, seeded_store.uri, script)
    assert _dump(path) == before


def test_an_empty_store_says_what_is_missing_on_every_page(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    for script in ("overview.py", "compare.py", "sweeps.py", "curves.py", "energy_diagnostics.py",
                   "recursion.py", "model_registry.py"):
        at = page(monkeypatch, uri, script)
        assert at.info, script
    import sqlalchemy as sa

    tables = sa.inspect(sa.create_engine(uri)).get_table_names()
    assert not [t for t in tables if t.startswith("cemlab")]  # the ledger was never created


def test_an_unreachable_server_is_one_clear_message(monkeypatch):
    from tests.conftest import free_port

    at = page(monkeypatch, f"http://127.0.0.1:{free_port()}", "overview.py")
    assert len(at.error) == 1 and "does not answer" in at.error[0].value
    assert "make up" in at.error[0].value


def test_the_synthetic_law_is_what_the_seed_wrote(seeded_store):
    """The truth the page tests compare with: the store holds ``true_perplexity``."""
    from mlflow import MlflowClient

    client = MlflowClient(seeded_store.uri)
    trials = {t.trial_id: t for t in seeded_store.seeded.trials["scaling-synthetic"]}
    exp = client.get_experiment_by_name("scaling-synthetic")
    for run in client.search_runs([exp.experiment_id], "tags.`cemlab.role` = 'trial'"):
        trial = trials[run.data.tags["cemlab.trial_id"]]
        assert run.data.metrics["test_perplexity"] == pytest.approx(
            page_bench.true_perplexity(trial), rel=5 * page_bench.NOISE)
    n = np.array([t.params["non_embedding"] for t in trials.values()], dtype=float)
    assert len(np.unique(n)) == 8 and math.isfinite(n.sum())  # 4 sizes x 2 families


def test_an_imported_study_without_its_bundle_says_what_is_missing_and_where_to_look(
        imported_study, monkeypatch):
    """The served store holds the study as imported trials only; with no bundle to read, each
    page names the trials it cannot describe and the variable that points at their bundle."""
    monkeypatch.setenv("CEMLAB_BUNDLES", "")
    for script in ("paper.py", "compare.py", "sweeps.py", "recursion.py"):
        at = page(monkeypatch, imported_study.served, script)
        (warning,) = [w.value for w in at.warning if "no MLflow run" in w.value]
        assert warning.startswith("12 finished trial(s) of `fig2a-cpu` have no MLflow run in "
                                  "this tracking store and no result bundle read here holds "
                                  "their run's data (bundles read: none)"), script
        assert "`CEMLAB_BUNDLES`" in warning


def _bundle_metrics(study) -> dict[str, dict[str, float]]:
    """The bundle's final metrics of each trial, by its dashboard label, read with pandas."""
    import json

    import pandas as pd

    frame = pd.read_parquet(study.bundle / "trials.parquet")
    return {f"{r.variant}@{r.size} lr={r.lr:g} seed={r.seed}": json.loads(r.metrics)
            for r in frame.itertuples()}


def test_an_imported_study_shows_its_bundles_evaluations_and_says_what_a_bundle_lacks(
        imported_study, monkeypatch):
    """Test-time recursion tabulates the bundle's values; the pages that need what a bundle
    does not hold (training curves, energy diagnostics) say so instead of showing nothing."""
    monkeypatch.setenv("CEMLAB_BUNDLES", str(imported_study.bundle))
    at = page(monkeypatch, imported_study.served, "recursion.py")
    assert not at.warning
    table = at.dataframe[0].value
    bundle = _bundle_metrics(imported_study)
    assert len(table) == 3  # each size's best CEM trial on validation
    for label, row in table.iterrows():
        for rule in ("kept", "scaled"):
            for t in (1, 2, 4):
                assert row[f"{rule} T={t}"] == bundle[label][f"test_time/T{t}_{rule}/perplexity"]
    at = page(monkeypatch, imported_study.served, "energy_diagnostics.py")
    assert "holds no energy diagnostics" in at.info[0].value
    at = page(monkeypatch, imported_study.served, "curves.py")
    assert "not their training curves" in at.info[0].value


def test_an_empty_store_names_the_committed_results_to_import(imported_study, tmp_path,
                                                               monkeypatch):
    """Where the repository has committed bundles, the empty state gives the command that
    imports them."""
    import shutil

    from dashboards import reads

    committed = tmp_path / "repo" / "docs" / "results" / "data"
    shutil.copytree(imported_study.bundle, committed)
    monkeypatch.setattr(reads, "COMMITTED_BUNDLES", committed)
    monkeypatch.delenv("CEMLAB_BUNDLES", raising=False)
    at = page(monkeypatch, f"sqlite:///{tmp_path / 'mlflow.db'}", "compare.py")
    assert at.info[0].value.endswith(
        " `cemlab import docs/results/data` brings the committed results.")
