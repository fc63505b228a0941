"""The dashboard's analysis: plain functions from the frames of ``dashboards.reads`` to the
frames its figures draw (no Streamlit, no I/O). The learning rate of every (variant, size,
seed) is chosen on validation and the test metric read there (``orchestrator.science.analysis``), as
``orchestrator results`` and the claims report do."""

from __future__ import annotations

import datetime as dt
import math

import numpy as np
import pandas as pd

from orchestrator.planning.calibrate import TRIAL_OVERHEAD_S
from orchestrator.science.analysis import Point, seed_choices

GROUP = ["experiment", "dataset", "variant", "size"]
STATUSES = ("PENDING", "RUNNING", "FINISHED", "FAILED")


def family(attention: str | None, mlp: str | None, position: str | None = None) -> str:
    """``Llama``, ``CEM attention``, ``CEM MLP`` or ``CEM (both)`` from the sublayer kinds,
    `` (ALiBi)`` appended where Llama attention takes ALiBi (a control arm, never fitted with
    RoPE's points; CEM attention is ALiBi by construction)."""
    kinds = (attention == "cem", mlp == "cem")
    name = {(False, False): "Llama", (True, False): "CEM attention",
            (False, True): "CEM MLP", (True, True): "CEM (both)"}[kinds]
    return f"{name} (ALiBi)" if attention != "cem" and position == "alibi" else name


def metric_of(runs: pd.DataFrame) -> str:
    """The test metric of ``runs``: ``test_perplexity`` (language models) or ``test_rmse``."""
    return "test_rmse" if runs["test_rmse"].notna().any() and not runs[
        "test_perplexity"].notna().any() else "test_perplexity"


def finished(runs: pd.DataFrame, metric: str) -> pd.DataFrame:
    """The runs the ledger marks FINISHED that have ``metric`` and its validation twin."""
    val = metric.replace("test_", "val_")
    return runs[(runs["status"] == "FINISHED") & runs[metric].notna() & runs[val].notna()]


def chosen(runs: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Per (experiment, dataset, variant, size, seed): the learning rate chosen on validation
    (Akima optimum over log2 LR; the only LR of a one-point grid), ``val`` there, ``test`` (the
    test interpolant at that LR), ``nearest`` (test at the nearest trained LR), ``at_edge``,
    and the group's sizes (parameters, tokens, ``train_flops``, sublayer kinds, ``family``)."""
    done = finished(runs, metric)
    val = metric.replace("test_", "val_")
    rows = []
    for exp, part in done.groupby("experiment", sort=False):
        points = [Point(r.dataset, r.variant, r.size, int(r.seed), float(r.lr),
                        float(getattr(r, val)), float(getattr(r, metric)))
                  for r in part.itertuples()]
        first = part.drop_duplicates(["dataset", "variant", "size"]).set_index(
            ["dataset", "variant", "size"])
        for (dataset, variant, size), by_seed in seed_choices(points).items():
            info = first.loc[(dataset, variant, size)]
            for seed, c in by_seed.items():
                rows.append({
                    "experiment": exp, "dataset": dataset, "variant": variant, "size": size,
                    "seed": seed, "lr": c.lr, "val": c.val, "test": c.test,
                    "nearest": c.nearest, "at_edge": c.at_edge, "lrs": c.n_points,
                    "family": family(info["attention"], info["mlp"], info["position"]),
                    **{k: info[k] for k in ("attention", "mlp", "params_total",
                                            "params_non_embedding", "params_attention",
                                            "params_mlp", "tokens", "train_flops")}})
    return pd.DataFrame(rows, columns=[
        *GROUP, "seed", "lr", "val", "test", "nearest", "at_edge", "lrs", "family",
        "attention", "mlp", "params_total", "params_non_embedding", "params_attention",
        "params_mlp", "tokens", "train_flops"])


def summary(points: pd.DataFrame) -> pd.DataFrame:
    """``chosen`` points as mean ± std over seeds per (experiment, dataset, variant, size):
    columns ``GROUP``, ``family``, ``seeds``, ``test``, ``test_std`` (sample std, 0 for one
    seed), ``lr`` (mean chosen LR), ``edge_seeds`` and the sizes."""
    if points.empty:
        return pd.DataFrame(columns=[*GROUP, "family", "seeds", "test", "test_std", "lr",
                                     "edge_seeds", "params_total", "params_non_embedding",
                                     "train_flops"])
    out = points.groupby(GROUP, sort=False).agg(
        family=("family", "first"), seeds=("seed", "nunique"), test=("test", "mean"),
        test_std=("test", "std"), lr=("lr", "mean"), edge_seeds=("at_edge", "sum"),
        params_total=("params_total", "first"),
        params_non_embedding=("params_non_embedding", "first"),
        train_flops=("train_flops", "first")).reset_index()
    out["test_std"] = out["test_std"].fillna(0.0)
    return out


def progress(experiments: list[dict], trials: dict[str, list[dict]], runs: pd.DataFrame,
             rates: dict[str, tuple[float, float]],
             now: dt.datetime | None = None) -> pd.DataFrame:
    """One row per ledger experiment: trials by status, elapsed time, and the remaining time
    as ``plan`` estimates a trial (its FLOPs over a FLOP/s rate, plus ``TRIAL_OVERHEAD_S``),
    with the rate measured by the experiment's finished trials instead of a calibration step;
    running trials count what is left of their estimate, and as many trials run at once as
    run now. ``remaining_s`` is NaN until a trial has finished (no rate yet) and 0 when
    nothing is left.

    ``trials``: experiment name -> ``reads.ledger_trials``; ``runs``: ``reads.trial_runs`` of
    the experiments with unfinished trials; ``rates``: experiment name -> ``(FLOPs, seconds)``
    of its finished trials' train steps (``reads.train_rate``)."""
    now = now or dt.datetime.now(dt.UTC).replace(tzinfo=None)
    out = []
    for e in experiments:
        rows = trials.get(e["name"], [])
        counts = {s: sum(r["status"] == s for r in rows) for s in STATUSES}
        starts = [r["started_at"] for r in rows if r["started_at"]]
        ends = [r["finished_at"] for r in rows if r["finished_at"]]
        active = counts["RUNNING"] > 0
        elapsed = ((now if active else max(ends, default=now)) - min(starts)).total_seconds() \
            if starts else 0.0
        mine = runs[runs["experiment"] == e["name"]]
        out.append({"experiment": e["name"], "workload": e["workload"], **{
            s.lower(): counts[s] for s in STATUSES}, "trials": len(rows),
            "done": (counts["FINISHED"] + counts["FAILED"]) / len(rows) if rows else 0.0,
            "elapsed_s": elapsed,
            "remaining_s": _remaining(rows, mine, rates.get(e["name"], (0.0, 0.0)), now),
            "created": e["created_at"]})
    return pd.DataFrame(out, columns=["experiment", "workload", "pending", "running",
                                      "finished", "failed", "trials", "done", "elapsed_s",
                                      "remaining_s", "created"])


def _remaining(rows: list[dict], runs: pd.DataFrame, rate: tuple[float, float],
               now: dt.datetime) -> float:
    left = [r for r in rows if r["status"] in ("PENDING", "RUNNING")]
    if not left:
        return 0.0
    flops_done, seconds = rate
    if flops_done <= 0 or seconds <= 0:
        return math.nan
    per_s = flops_done / seconds
    flops = runs.set_index("trial")["train_flops"] if not runs.empty else pd.Series(dtype=float)
    known = flops.dropna()
    total = 0.0
    for r in left:
        f = flops.get(r["trial"])
        f = known.mean() if f is None or pd.isna(f) else f  # a group MLflow has no run of yet
        estimate = f / per_s + TRIAL_OVERHEAD_S
        if r["status"] == "RUNNING" and r["started_at"]:
            estimate = max(estimate - (now - r["started_at"]).total_seconds(), 0.0)
        total += estimate
    return total / max(sum(r["status"] == "RUNNING" for r in rows), 1)


TIME_PHASES = ("startup", "compile", "train", "eval", "checkpoint", "teardown")


def time_split(times: dict[str, list[dict[str, float]]]) -> pd.DataFrame:
    """Where each experiment's time went: one row per experiment of ``times`` (name -> its
    finished trials' ``time/*`` metrics, ``reads.time_metrics``) with a finished trial. Columns:
    ``experiment``, ``trials`` (those that trained here), ``in train steps`` (the share of their
    summed ``time/total_s``), each phase of ``TIME_PHASES`` in seconds summed over them,
    ``queued`` (seconds summed, outside the total) and ``first step after submit`` (the
    earliest trial's, seconds; NaN where not logged)."""
    rows = []
    for name, trials in times.items():
        trained = [t for t in trials if t.get("time/total_s", 0.0) > 0]
        if not trained:
            continue
        total = sum(t["time/total_s"] for t in trained)
        firsts = [t["time/first_step_s"] for t in trained if "time/first_step_s" in t]
        rows.append({"experiment": name, "trials": len(trained),
                     "in train steps": sum(t.get("time/train_s", 0.0) for t in trained) / total,
                     **{f"{phase} s": sum(t.get(f"time/{phase}_s", 0.0) for t in trained)
                        for phase in TIME_PHASES},
                     "total s": total,
                     "queued s": sum(t.get("time/queue_s", 0.0) for t in trained),
                     "first step after submit s": min(firsts) if firsts else math.nan})
    return pd.DataFrame(rows, columns=["experiment", "trials", "in train steps",
                                       *(f"{p} s" for p in TIME_PHASES), "total s", "queued s",
                                       "first step after submit s"])


def duration(seconds: float) -> str:
    """``42 s``, ``12 min``, ``3.4 h``; ``-`` for NaN (not known yet)."""
    if seconds is None or math.isnan(seconds):
        return "-"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def smooth(values: np.ndarray, weight: float) -> np.ndarray:
    """Exponential moving average with ``weight`` in [0, 1) (0: unchanged), bias-corrected as
    TensorBoard's smoothing is, so the first points are not pulled towards 0."""
    out, acc = np.empty(len(values)), 0.0
    for i, v in enumerate(values):
        acc = weight * acc + (1 - weight) * v
        out[i] = acc / (1 - weight ** (i + 1)) if weight else v
    return out


def seed_bands(history: pd.DataFrame, runs: pd.DataFrame, key: str, x: str,
               weight: float = 0.0) -> pd.DataFrame:
    """Metric ``key`` of ``history`` (``reads.metric_histories``) per group of runs that differ
    only by seed (variant, size, lr), smoothed per run (``smooth``), then mean, min and max over
    seeds at every step. ``x``: ``step``, ``tokens`` (step x the trial's tokens per step, its
    ``tokens`` over its ``steps``) or ``flops`` (tokens x ``flops_per_token``). Columns:
    ``group, x, mean, low, high, seeds``."""
    part = history[history["key"] == key]
    meta = runs.set_index("run_id")
    frames = []
    for rid, h in part.groupby("run_id"):
        if rid not in meta.index:
            continue
        r = meta.loc[rid]
        h = h.sort_values("step")
        steps = h["step"].to_numpy(dtype=float)
        per_step = float(r["tokens"]) / float(r["steps"]) if r["tokens"] and r["steps"] \
            else math.nan
        scale = {"step": 1.0, "tokens": per_step,
                 "flops": per_step * (r["flops_per_token"] or math.nan)}[x]
        frames.append(pd.DataFrame({
            "group": f"{r['variant']}@{r['size']} lr={r['lr']:g}", "x": steps * scale,
            "step": steps, "value": smooth(h["value"].to_numpy(dtype=float), weight)}))
    if not frames:
        return pd.DataFrame(columns=["group", "x", "mean", "low", "high", "seeds"])
    allr = pd.concat(frames)
    return allr.groupby(["group", "step"]).agg(
        x=("x", "mean"), mean=("value", "mean"), low=("value", "min"), high=("value", "max"),
        seeds=("value", "size")).reset_index().drop(columns="step")


def recursion_pairs(summary: pd.DataFrame) -> pd.DataFrame:
    """``summary`` rows of variants named ``<setting>[-reuse]-t<T>`` (paper Fig. 3c / 4 specs)
    as ``setting, size, T, test, test_std``; ``-reuse`` (plain layer reuse) joins its
    setting's T=1 (``llama-t1`` and ``llama-reuse-t2`` are the setting ``llama``)."""
    parts = summary["variant"].str.extract(r"^(?P<setting>.+?)(?:-reuse)?-t(?P<T>\d+)$")
    out = summary.join(parts).dropna(subset=["setting"])
    out["T"] = out["T"].astype(int)
    return out[["setting", "size", "T", "test", "test_std"]].reset_index(drop=True)


def beside_paper(values: list, runs: pd.DataFrame, summary: pd.DataFrame) -> pd.DataFrame:
    """The paper's stated numbers (``dashboards.paper_values``) with ours beside them where we
    have the same quantity: total parameters of a (variant, size) we trained, a CEM sublayer's
    parameters over Llama's (``attn_param_ratio``, ``mlp_param_ratio``: mean over our sizes),
    and a variant's learning rate chosen on validation (``opt_lr``: mean over sizes)."""
    rows = []
    for v in values:
        mine = runs[runs["variant"] == v.variant]
        ours = math.nan
        if v.metric == "params_total" and (mine["size"] == v.size).any():
            ours = float(mine[mine["size"] == v.size]["params_total"].iloc[0])
        elif v.metric in ("attn_param_ratio", "mlp_param_ratio"):
            col = "params_attention" if v.metric == "attn_param_ratio" else "params_mlp"
            llama = runs[runs["attention"].ne("cem") & runs["mlp"].ne("cem")]
            base = llama.groupby("size")[col].first()
            ratio = (mine.groupby("size")[col].first() / base).dropna()
            ours = float(ratio.mean()) if not ratio.empty else math.nan
        elif v.metric == "opt_lr" and (summary["variant"] == v.variant).any():
            ours = float(summary[summary["variant"] == v.variant]["lr"].mean())
        rows.append({"quantity": v.metric, "variant": v.variant, "size": v.size,
                     "paper": v.value, "ours": ours, "source": v.source, "note": v.note})
    return pd.DataFrame(rows, columns=["quantity", "variant", "size", "paper", "ours",
                                       "source", "note"])
