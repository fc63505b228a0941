"""The dashboard's analysis functions against hand-computed values (no Streamlit, no store)."""

from __future__ import annotations

import datetime as dt
import math

import numpy as np
import pandas as pd
import pytest

from dashboards import frames
from orchestrator.planning.calibrate import TRIAL_OVERHEAD_S

T0 = dt.datetime(2026, 1, 1, 12, 0, 0)


def _runs(rows: list[dict]) -> pd.DataFrame:
    from dashboards.reads import RUN_COLUMNS

    return pd.DataFrame([{c: r.get(c) for c in RUN_COLUMNS} for r in rows],
                        columns=RUN_COLUMNS)


def test_remaining_time_is_flops_over_the_measured_rate_plus_the_plan_overhead():
    trials = [  # two finished, one running for 100 s, two pending; 1 running at a time
        {"trial": "a", "status": "FINISHED", "mlflow_run_id": "ra", "started_at": T0,
         "finished_at": T0 + dt.timedelta(seconds=300)},
        {"trial": "b", "status": "FINISHED", "mlflow_run_id": "rb", "started_at": T0,
         "finished_at": T0 + dt.timedelta(seconds=400)},
        {"trial": "c", "status": "RUNNING", "mlflow_run_id": "rc",
         "started_at": T0 + dt.timedelta(seconds=400), "finished_at": None},
        {"trial": "d", "status": "PENDING", "mlflow_run_id": "rd", "started_at": None,
         "finished_at": None},
        {"trial": "e", "status": "PENDING", "mlflow_run_id": None, "started_at": None,
         "finished_at": None},
    ]
    runs = _runs([{"experiment": "x", "trial": t, "train_flops": f}
                  for t, f in (("a", 2e12), ("b", 4e12), ("c", 6e12), ("d", 1e12))])
    rates = {"x": (2e12 + 4e12, 200.0 + 300.0)}  # the finished trials' train steps
    now = T0 + dt.timedelta(seconds=500)
    table = frames.progress([{"name": "x", "workload": "language_model", "created_at": T0}],
                            {"x": trials}, runs, rates, now)
    row = table.iloc[0]
    rate = 6e12 / 500.0  # FLOP/s the finished trials achieved
    running_left = 6e12 / rate + TRIAL_OVERHEAD_S - 100.0
    pending = 1e12 / rate + TRIAL_OVERHEAD_S
    no_run_yet = 13e12 / 4 / rate + TRIAL_OVERHEAD_S  # no run yet: the known trials' mean
    assert row["remaining_s"] == pytest.approx(running_left + pending + no_run_yet)
    assert row["elapsed_s"] == 500.0
    assert (row["finished"], row["running"], row["pending"], row["failed"]) == (2, 1, 2, 0)
    assert row["done"] == pytest.approx(2 / 5)


def test_remaining_time_is_unknown_before_a_trial_finishes():
    trials = [{"trial": "a", "status": "PENDING", "mlflow_run_id": None, "started_at": None,
               "finished_at": None}]
    table = frames.progress([{"name": "x", "workload": "lm", "created_at": T0}], {"x": trials},
                            _runs([]), {"x": (0.0, 0.0)}, T0)
    assert math.isnan(table.iloc[0]["remaining_s"])
    assert frames.duration(table.iloc[0]["remaining_s"]) == "-"


def test_smoothing_is_a_bias_corrected_moving_average():
    values = np.array([1.0, 3.0, 2.0])
    w = 0.5
    expect = [1.0, (0.25 * 1 + 0.5 * 3) / 0.75, (0.125 * 1 + 0.25 * 3 + 0.5 * 2) / 0.875]
    assert frames.smooth(values, w) == pytest.approx(expect)
    assert frames.smooth(values, 0.0).tolist() == values.tolist()


def test_seed_bands_average_seeds_on_a_token_axis():
    history = pd.DataFrame(
        [{"run_id": r, "key": "loss", "step": s, "value": v}
         for r, vals in (("r0", (4.0, 2.0)), ("r1", (6.0, 3.0))) for s, v in zip((1, 2), vals)])
    runs = _runs([{"run_id": r, "variant": "llama", "size": "nano", "lr": 0.002, "seed": i,
                   "flops_per_token": 10.0, "tokens": 2048.0, "steps": 2.0}
                  for i, r in enumerate(("r0", "r1"))])
    band = frames.seed_bands(history, runs, "loss", "tokens").sort_values("x")
    assert band["x"].tolist() == [1024.0, 2048.0]
    assert band["mean"].tolist() == [5.0, 2.5]
    assert band["low"].tolist() == [4.0, 2.0] and band["high"].tolist() == [6.0, 3.0]
    assert set(band["group"]) == {"llama@nano lr=0.002"} and band["seeds"].tolist() == [2, 2]
    flops = frames.seed_bands(history, runs, "loss", "flops")
    assert sorted(flops["x"]) == [10240.0, 20480.0]


def test_chosen_learning_rate_comes_from_validation_not_test():
    # validation is lowest at 0.002, test at 0.004: the choice is 0.002
    rows = [{"experiment": "x", "run_id": f"r{i}", "status": "FINISHED", "dataset": "d",
             "variant": "llama", "size": "nano", "attention": "llama", "mlp": "llama",
             "lr": lr, "seed": 0, "val_perplexity": val, "test_perplexity": test,
             "params_total": 10, "train_flops": 1.0}
            for i, (lr, val, test) in enumerate(((0.001, 12.0, 11.0), (0.002, 10.0, 10.5),
                                                 (0.004, 12.0, 9.0)))]
    points = frames.chosen(_runs(rows), "test_perplexity")
    assert points["lr"].tolist() == pytest.approx([0.002], rel=1e-2)
    assert points["nearest"].tolist() == [10.5]
    assert points["family"].tolist() == ["Llama"]


def test_recursion_pairs_join_plain_reuse_to_its_setting():
    summary = pd.DataFrame({"variant": ["llama-t1", "llama-reuse-t2", "cem-attn-t1",
                                        "cem-attn-t2", "llama"],
                            "size": "nano", "test": [30.0, 29.0, 34.0, 33.0, 30.0],
                            "test_std": 0.1})
    pairs = frames.recursion_pairs(summary)
    assert pairs[["setting", "T", "test"]].values.tolist() == [
        ["llama", 1, 30.0], ["llama", 2, 29.0], ["cem-attn", 1, 34.0], ["cem-attn", 2, 33.0]]


def test_the_time_split_sums_phases_of_trials_trained_here_and_takes_the_first_step():
    def trial(train, total, queue, first):
        return {"time/startup_s": 5.0, "time/train_s": train, "time/eval_s": 1.0,
                "time/total_s": total, "time/queue_s": queue, "time/first_step_s": first}

    split = frames.time_split({
        "a": [trial(30.0, 40.0, 0.0, 9.0), trial(50.0, 60.0, 40.0, 49.0),
              {"time/total_s": 0.0}],  # a copy from another experiment's cache
        "b": [{"time/total_s": 0.0}], "c": []}).set_index("experiment")
    assert list(split.index) == ["a"]  # b and c trained nothing here
    row = split.loc["a"]
    assert row["trials"] == 2 and row["in train steps"] == pytest.approx(0.8)
    assert (row["startup s"], row["train s"], row["eval s"], row["compile s"]) == (
        10.0, 80.0, 2.0, 0.0)
    assert (row["total s"], row["queued s"], row["first step after submit s"]) == (
        100.0, 40.0, 9.0)
    assert math.isnan(frames.time_split({"d": [{"time/total_s": 10.0}]})
                      .loc[0, "first step after submit s"])


def test_a_family_is_the_sublayer_kinds_and_alibi_on_llama_attention():
    assert frames.family("llama", "llama") == frames.family("llama", "llama", "rope") == "Llama"
    assert frames.family("llama", "llama", "alibi") == "Llama (ALiBi)"
    assert frames.family("llama", "cem", "alibi") == "CEM MLP (ALiBi)"
    assert frames.family("cem", "llama", "alibi") == "CEM attention"  # ALiBi by construction
    assert frames.family("cem", "cem") == "CEM (both)"
