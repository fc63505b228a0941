"""Results from the ledger: the rows of a spec's current grid, progress by status; the optima
stored on the parent run."""

import json

import pandas as pd
from mlflow import MlflowClient

from orchestrator.planning.spec import parse_spec
from orchestrator.records.ledger import Ledger, Status
from orchestrator.science.results import (
    experiment_rows,
    format_efficiency,
    format_status,
    format_time_split,
    status_counts,
    store_on_parent,
)


def test_results_read_the_newest_row_per_grid_point(tmp_path):
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


def test_a_point_a_bracket_added_counts_where_the_grid_s_bracket_reaches_it(tmp_path):
    """Rows added by rounds (``lr_round``) belong to the grid when its bracket can reach their
    learning rate; one left by another grid (or at a point no round adds) does not, nor does a
    row at the same learning rate that no round added."""
    grid = [0.001, 0.002, 0.004]
    spec = parse_spec({"name": "adapts", "sizes": ["nano"], "variants": {"llama": {}},
                       "learning_rates": {"grid": grid, "max_points": 5}})
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    exp = ledger.ensure_experiment("adapts", "language_model", "")
    point = {"dataset": "shakespeare", "variant": "llama", "size": "nano", "seed": 0}
    kept = [ledger.ensure_trial(exp.id, f"g{i}", lr=lr, **point) for i, lr in enumerate(grid)]
    kept += [ledger.ensure_trial(exp.id, "up1", lr=0.008, lr_round=1, **point),
             ledger.ensure_trial(exp.id, "up2", lr=0.016, lr_round=2, **point)]
    ledger.ensure_trial(exp.id, "past-cap", lr=0.032, lr_round=3, **point)
    ledger.ensure_trial(exp.id, "other-grid", lr=0.006, lr_round=1, **point)
    assert [r.id for r in experiment_rows(spec, ledger)] == [r.id for r in kept]
    fixed = parse_spec({"name": "adapts", "sizes": ["nano"], "variants": {"llama": {}},
                        "learning_rates": grid})
    assert [r.id for r in experiment_rows(fixed, ledger)] == [r.id for r in kept[:3]]


def test_status_counts_and_progress_come_from_the_ledger(tmp_path):
    spec = parse_spec({"name": "progress", "sizes": ["nano"], "variants": {"llama": {}},
                       "learning_rates": [0.001, 0.002, 0.004]})
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    exp = ledger.ensure_experiment("progress", "language_model", "")
    point = {"dataset": "shakespeare", "variant": "llama", "size": "nano", "seed": 0}
    done = ledger.ensure_trial(exp.id, "a", lr=0.001, **point)
    ledger.update_trial(done.id, status=Status.FINISHED, metric=123.25)
    running = ledger.ensure_trial(exp.id, "b", lr=0.002, **point)
    ledger.update_trial(running.id, status=Status.RUNNING)
    failed = ledger.ensure_trial(exp.id, "c", lr=0.004, **point)
    ledger.update_trial(failed.id, status=Status.FAILED,
                        error="WorkerGroupError: Training failed\n...\nThe actor died.\n")
    rows = experiment_rows(spec, ledger)
    assert status_counts(rows) == {Status.PENDING: 0, Status.RUNNING: 1, Status.FINISHED: 1,
                                   Status.FAILED: 1}
    text = format_status(spec, rows, planned=4)  # as if the spec had grown by one trial
    assert text.splitlines()[0] == ("experiment progress: 4 trial(s) planned, 0 pending, "
                                    "1 running, 1 finished, 1 failed, 1 not yet submitted")
    assert "123.25" in text and "RUNNING" in text
    assert text.splitlines()[-1] == "c failed: WorkerGroupError: Training failed"


def test_the_time_split_and_efficiency_summarise_finished_trials():
    def trial(variant, size, mfu, mib, train, total):
        return {"variant": variant, "size": size,
                "metrics": {"train_mfu": mfu, "peak_memory_mib": mib, "time/train_s": train,
                            "time/startup_s": total - train, "time/total_s": total}}

    trials = [trial("llama", "nano", 0.10, 800.0, 30.0, 40.0),
              trial("llama", "nano", 0.20, 900.0, 30.0, 40.0),
              trial("cem", "nano", 0.05, 1200.0, 20.0, 40.0)]
    split = format_time_split(trials)
    assert split.startswith("time split of 3 finished trial(s): 67% in train steps")
    assert "startup 40 s, train 80 s" in split and "120 s in all" in split
    rows = {line.split()[0]: line.split() for line in format_efficiency(trials).splitlines()
            if line.startswith(("llama", "cem"))}
    assert rows["llama"][1:] == ["nano", "2", "15.0%", "10.0%-20.0%", "900", "MiB"]
    assert rows["cem"][1:] == ["nano", "1", "5.0%", "5.0%-5.0%", "1,200", "MiB"]
    assert format_time_split([]).startswith("time split: no finished trial")
    for t, queue, first in zip(trials, (0.0, 40.0, 80.0), (12.5, 52.0, 93.0), strict=True):
        t["metrics"].update({"time/queue_s": queue, "time/first_step_s": first})
    assert format_time_split(trials).endswith(
        "120 s in all); before that, 120 s queued for a slot of the grid; first train step "
        "12.5 s after submit")
    assert "no finished trial has logged them" in format_efficiency(trials[:0])


def test_an_evaluation_seed_s_row_counts_at_any_lr_the_bracket_reaches(tmp_path):
    """An evaluation seed trains at its arm's chosen learning rate, which a round may have
    added: its row is on the grid there without a round of its own; a seed that neither tunes
    nor evaluates is not, nor is an evaluation row at a learning rate no round reaches."""
    spec = parse_spec({"name": "evals", "sizes": ["nano"], "variants": {"llama": {}},
                       "seeds": [0, 1], "learning_rates": {"grid": [0.001, 0.002, 0.004],
                                                           "max_points": 5,
                                                           "eval_seeds": [7, 8]}})
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    exp = ledger.ensure_experiment("evals", "language_model", "")
    point = {"dataset": "shakespeare", "variant": "llama", "size": "nano"}
    kept = [ledger.ensure_trial(exp.id, "tune", lr=0.002, seed=0, **point),
            ledger.ensure_trial(exp.id, "eval-grid", lr=0.002, seed=7, **point),
            ledger.ensure_trial(exp.id, "eval-added", lr=0.008, seed=8, **point)]
    ledger.ensure_trial(exp.id, "eval-far", lr=0.064, seed=8, **point)  # beyond max_points
    ledger.ensure_trial(exp.id, "other-seed", lr=0.002, seed=3, **point)
    ledger.ensure_trial(exp.id, "tune-unadded", lr=0.008, seed=1, **point)  # no round added it
    assert [r.id for r in experiment_rows(spec, ledger)] == [r.id for r in kept]
    text = format_status(spec, experiment_rows(spec, ledger), planned=6)
    assert text.splitlines()[0] == (
        "experiment evals: 6 trial(s) planned, 3 pending, 0 running, 0 finished, 0 failed, 5 "
        "not yet submitted; and 2 evaluation trial(s) (seeds 7, 8 at each arm's chosen "
        "learning rate, planned once its bracket settles), 2 of them in the ledger")


def test_a_resubmission_replaces_the_parent_s_optima_table_instead_of_appending_to_it(tmp_path):
    """Each submission stores the optima it computed; the parent's table holds the newest
    (in the format, and with the tag, that ``MlflowClient.load_table`` reads), whatever an
    earlier submission stored."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("optima", artifact_location=str(tmp_path / "art"))
    parent = client.create_run(experiment).info.run_id
    keys = ("opt_lr", "opt_lr_std", "opt_val_perplexity", "opt_val_perplexity_std",
            "opt_perplexity", "opt_perplexity_std", "nearest_perplexity")

    def row(variant: str, lr: float) -> dict:
        return {"dataset": "shakespeare", "variant": variant, "size": "nano",
                **dict.fromkeys(keys, 1.0), "opt_lr": lr}

    first = [row("llama", 0.004), row("cem", 0.008)]
    store_on_parent(client, parent, first, "perplexity")
    second = [row("llama", 0.002), row("cem", 0.006)]  # more learning rates trained since
    store_on_parent(client, parent, second, "perplexity")
    # read as MlflowClient.load_table reads a table artifact, found by the same tag
    table = pd.read_json(client.download_artifacts(parent, "akima_optima.json", str(tmp_path)),
                         orient="split")
    tags = client.get_run(parent).data.tags
    assert json.loads(tags["mlflow.loggedArtifacts"]) == [
        {"path": "akima_optima.json", "type": "table"}]
    assert table["opt_lr"].tolist() == [0.002, 0.006]
    assert table["variant"].tolist() == ["llama", "cem"]
    metric = client.get_run(parent).data.metrics["shakespeare/cem/nano/opt_lr"]
    assert metric == 0.006
