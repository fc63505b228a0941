"""The dashboard's reads of trials imported from a result bundle (no MLflow run here): a study
written as ``cemlab run`` writes it, exported and imported into a fresh store (real SQLite
MLflow stores and ledgers), reads from its bundle as it reads from MLflow where it trained."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pandas as pd
import pytest

from dashboards import page_bench, reads
from tests.conftest import DASHBOARD_STORE

pytestmark = DASHBOARD_STORE  # the imported study is made once, where the pages read it too
ROOT = Path(__file__).resolve().parents[2]
SAME = ["experiment", "run_name", "status", "dataset", "variant", "size", "lr", "seed", "trial",
        "test_perplexity", "val_perplexity", "test_rmse", "val_rmse", "attention", "mlp",
        "params_total", "params_non_embedding", "params_embedding", "params_attention",
        "params_mlp", "flops_per_token", "tokens", "steps", "position", "train_flops"]


def test_bundles_are_read_from_the_environment_else_from_the_committed_results(monkeypatch):
    monkeypatch.delenv("CEMLAB_BUNDLES", raising=False)
    committed = ROOT / "docs" / "results" / "data"
    assert reads.bundle_dirs() == ((str(committed),) if committed.is_dir() else ())
    monkeypatch.setenv("CEMLAB_BUNDLES", os.pathsep.join(["/data/a", "", "/data/b"]))
    assert reads.bundle_dirs() == ("/data/a", "/data/b")
    monkeypatch.setenv("CEMLAB_BUNDLES", "")
    assert reads.bundle_dirs() == ()


def test_a_runs_test_time_metrics_and_trained_steps_are_read_from_their_names():
    metrics = {"test_perplexity": 30.0, "test_time/T4_scaled/perplexity": 31.5,
               "test_time/T1_kept/perplexity": 33.0, "test_time/T2_kept/energy": -4.0,
               "test_time/T8_halved/perplexity": 40.0, "val_perplexity": 30.3}
    assert reads.recursion_rows(metrics) == [(4, "scaled", 31.5), (1, "kept", 33.0)]
    params = {"model.attn_steps": "2", "model.mlp_steps": "3"}
    assert reads.trained_steps({"attention": "cem", "mlp": "llama"}, params) == 2
    assert reads.trained_steps({"attention": "llama", "mlp": "cem"}, params) == 3
    assert reads.trained_steps({"attention": "cem", "mlp": "cem"}, params) == 0  # they differ
    assert reads.trained_steps({"attention": "cem", "mlp": "cem"},
                               {"model.attn_steps": "4", "model.mlp_steps": "4"}) == 4
    assert reads.trained_steps({"attention": "llama", "mlp": "llama"}, params) == 0


def _by_trial(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.sort_values("trial", ignore_index=True)


def test_an_imported_trial_reads_as_its_mlflow_run_did_where_it_trained(imported_study):
    """The served store has no MLflow run of the study: every column the trained store's runs
    give comes from the bundle, equal; parameter counts, tokens, steps and FLOPs per token are
    the planned trials'."""
    study = imported_study
    imported = _by_trial(reads.experiment_trials(study.served, study.served, "fig2a-cpu",
                                                 (str(study.bundle),)))
    trained = _by_trial(reads.experiment_trials(study.trained, study.trained, "fig2a-cpu"))
    assert len(imported) == len(study.trials) == 12
    assert set(imported["source"]) == {"bundle"} and imported["run_id"].isna().all()
    assert set(trained["source"]) == {"mlflow"} and trained["run_id"].notna().all()
    pd.testing.assert_frame_equal(imported[SAME], trained[SAME])
    planned = {t.trial_id: t for t in study.trials}
    for row in imported.itertuples():
        t = planned[row.trial]
        assert (row.variant, row.size, row.lr, row.seed) == (t.variant, t.size, t.lr, t.seed)
        assert (row.attention, row.mlp) == (t.model.attention, t.model.mlp)
        assert (row.params_total, row.params_non_embedding, row.params_attention) == (
            t.params["total"], t.params["non_embedding"], t.params["attention"])
        assert (row.tokens, row.steps) == (t.tokens, t.steps)
        assert row.flops_per_token == pytest.approx(t.budget.flops / t.tokens, rel=1e-12)
        assert row.train_flops == pytest.approx(t.budget.flops, rel=1e-12)


def test_without_its_bundle_an_imported_trial_has_the_ledgers_fields_alone(imported_study):
    study = imported_study
    frame = reads.experiment_trials(study.served, study.served, "fig2a-cpu", ())
    bundle = pd.read_parquet(study.bundle / "trials.parquet").set_index("trial_hash")
    assert set(frame["source"]) == {"ledger"}
    assert frame["params_total"].isna().all() and frame["attention"].isna().all()
    assert frame.set_index("trial")["test_perplexity"].to_dict() == bundle["metric"].to_dict()


def test_test_time_evaluations_of_imported_trials_are_those_logged_where_they_trained(
        imported_study):
    """From the bundle, from MLflow, or each trial from where it is (half of them given no
    run): one frame, each value the law ``page_bench`` logged for the trial's test perplexity."""
    study = imported_study
    runs = reads.experiment_trials(study.trained, study.trained, "fig2a-cpu")
    cem = runs[runs["attention"] == "cem"].sort_values("trial")
    pairs = tuple(zip(cem["trial"], cem["run_id"]))
    logged = reads.trial_recursion_perplexities(study.trained, (), pairs)
    imported = reads.trial_recursion_perplexities(study.served, (str(study.bundle),), tuple(
        (trial, None) for trial, _ in pairs))
    mixed = reads.trial_recursion_perplexities(study.trained, (str(study.bundle),), tuple(
        (trial, run_id if i % 2 else None) for i, (trial, run_id) in enumerate(pairs)))
    pd.testing.assert_frame_equal(imported, logged)
    pd.testing.assert_frame_equal(mixed, logged)
    assert len(logged) == len(cem) * 3 * 2  # T_eval 1, 2, 4; eta kept and scaled
    planned = {t.trial_id: t for t in study.trials}
    test = cem.set_index("trial")["test_perplexity"]
    for row in imported.itertuples():
        assert row.t_train == 2
        assert row.perplexity == pytest.approx(page_bench.recursion_perplexity(
            planned[row.trial], test[row.trial], row.t_eval, row.rule), rel=1e-12)
    assert reads.trial_recursion_perplexities(study.served, (), tuple(
        (trial, None) for trial, _ in pairs)).empty  # no bundle: nothing to read


def test_a_path_without_a_verified_bundle_is_named_and_skipped(imported_study, tmp_path):
    study = imported_study
    altered = tmp_path / "altered"
    shutil.copytree(study.bundle, altered)
    data = bytearray((altered / "trials.parquet").read_bytes())
    data[len(data) // 2] ^= 0x01
    (altered / "trials.parquet").write_bytes(bytes(data))
    shelf = tmp_path / "shelf"
    shutil.copytree(study.bundle, shelf / "fig2a-cpu")
    (tmp_path / "empty").mkdir()
    held = reads.bundle_trials((str(altered), str(tmp_path / "empty"), str(shelf)))
    assert held.bundles == (str(shelf / "fig2a-cpu"),)
    assert len(held.unread) == 2
    assert held.unread[0].startswith(f"{altered / 'trials.parquet'}: checksum mismatch")
    assert held.unread[1].startswith(f"{tmp_path / 'empty'}: no bundle")
    assert set(held.trials) == {t.trial_id for t in study.trials}
    assert {r["bundle"] for r in held.trials.values()} == {str(shelf / "fig2a-cpu")}
