"""From the ledger to an experiment's results: its rows on the current grid, Akima optima per
(dataset, variant, size) chosen on validation with test reported there, stored on the MLflow
parent run and printed; progress by status."""

from __future__ import annotations

import math
from collections.abc import Callable

import pandas as pd
from mlflow import MlflowClient
from mlflow.entities import Metric

from orchestrator.analysis import Point, optima_table
from orchestrator.brackets import reachable, same_lr
from orchestrator.ledger import Ledger, Status, TrialRow
from orchestrator.spec import ExperimentSpec
from orchestrator.table import format_table
from workloads.core.trial import PHASES

TABLE_ARTIFACT = "akima_optima.json"


def metric_name(spec: ExperimentSpec) -> str:
    """The test metric a trial of ``spec`` is judged by (the workload's, e.g. test perplexity)."""
    return spec.workload_impl.metric


def short_metric(spec: ExperimentSpec) -> str:
    """``metric_name`` without ``test_`` (``perplexity``, ``rmse``): the optima's column."""
    return metric_name(spec).removeprefix("test_")


def on_grid(spec: ExperimentSpec) -> Callable[[TrialRow], bool]:
    """Whether a ledger row lies on the spec's current grid (a spec edited to a smaller grid
    keeps its old rows in the ledger, outside the analysis); with brackets that extend, a
    learning rate that a round added (``lr_round``) counts as the grid's where the grid's
    brackets can reach it (``brackets.reachable``). The grid is resolved once, not per row."""
    datasets = set(spec.workload_impl.datasets(spec.workload_config))
    grid = spec.lr_grid
    added = reachable(grid, spec.lr_max_points) if spec.lr_max_points else []

    def check(row: TrialRow) -> bool:
        lrs = [*grid, *added] if row.lr_round else grid
        return (row.dataset in datasets and row.variant in spec.variants
                and row.size in spec.sizes and row.seed in spec.seeds
                and any(same_lr(row.lr, lr) for lr in lrs))
    return check


def experiment_rows(spec: ExperimentSpec, ledger: Ledger,
                    trial_ids: set[str] | None = None) -> list[TrialRow]:
    """The ledger rows of ``spec``'s experiment (empty if never run): those of ``trial_ids``
    when given, else those on the spec's current grid, the newest row per grid point (an edited
    spec gives its trials new hashes)."""
    exp = ledger.experiment(spec.name)
    rows = ledger.trials(exp.id) if exp else []
    if trial_ids is not None:
        return [r for r in rows if r.trial_hash in trial_ids]
    grid = on_grid(spec)
    newest = {(r.dataset, r.variant, r.size, r.lr, r.seed): r for r in rows if grid(r)}
    return sorted(newest.values(), key=lambda r: r.id)


def finished_points(rows: list[TrialRow]) -> list[Point]:
    """The finished rows as ``Point``s, those with finite validation and test metrics: a trial
    finished before validation metrics were recorded has none, and one that diverged (NaN or
    infinite metrics) chooses nothing; both are left out."""
    return [Point(r.dataset, r.variant, r.size, r.seed, r.lr, r.val_metric, r.metric)
            for r in rows if r.status == Status.FINISHED and r.metric is not None
            and r.val_metric is not None and math.isfinite(r.metric)
            and math.isfinite(r.val_metric)]


def optima(spec: ExperimentSpec, rows: list[TrialRow]) -> list[dict]:
    """``optima_table`` of the finished rows (``finished_points``)."""
    points = finished_points(rows)
    return optima_table(points, short_metric(spec)) if points else []


def store_on_parent(client: MlflowClient, parent_run_id: str, table: list[dict],
                    metric: str) -> None:
    """Log the optima as metrics ``<dataset>/<variant>/<size>/opt_lr`` (the LR chosen on
    validation), ``opt_val_<metric>``, ``opt_<metric>`` (test at that LR), with ``_std``, and
    ``nearest_<metric>``; and the whole table as artifact ``akima_optima.json`` of the parent
    run."""
    keys = ("opt_lr", "opt_lr_std", f"opt_val_{metric}", f"opt_val_{metric}_std",
            f"opt_{metric}", f"opt_{metric}_std", f"nearest_{metric}")
    metrics = [Metric(f"{row['dataset']}/{row['variant']}/{row['size']}/{key}",
                      float(row[key]), 0, 0) for row in table for key in keys]
    if metrics:
        client.log_batch(parent_run_id, metrics=metrics)
        client.log_table(parent_run_id, data=pd.DataFrame(table), artifact_file=TABLE_ARTIFACT)


def format_optima(table: list[dict], metric: str) -> str:
    """The optima as a terminal table (mean ± std over seeds: the LR chosen on validation,
    validation there, test there), then warnings."""
    rows = [{"dataset": r["dataset"], "variant": r["variant"], "size": r["size"],
             "seeds": r["seeds"], "LRs": r["lrs"],
             "optimal LR (val)": _pm(r["opt_lr"], r["opt_lr_std"], "{:.2e}"),
             f"val {metric}": _pm(r[f"opt_val_{metric}"], r[f"opt_val_{metric}_std"], "{:.3f}"),
             f"optimal {metric} (test)": _pm(r[f"opt_{metric}"], r[f"opt_{metric}_std"],
                                             "{:.3f}"),
             f"test {metric}, nearest LR": f"{r[f'nearest_{metric}']:.3f}"} for r in table]
    warnings = [f"warning: {r['variant']}@{r['size']} ({r['dataset']}): {r['warning']}"
                for r in table if r["warning"]]
    return "\n".join([format_table(rows), *warnings])


def _pm(mean: float, std: float, fmt: str) -> str:
    return f"{fmt.format(mean)} ± {fmt.format(std)}"


def status_counts(rows: list[TrialRow]) -> dict[Status, int]:
    """How many rows have each status, every ``Status`` present."""
    return {s: sum(r.status == s for r in rows) for s in Status}


def format_time_split(trials: list[dict]) -> str:
    """One line: the share of the ``trials``' wall time (``tracking.finished_trials``) spent in
    train steps, and the seconds of every phase (``workloads.runtime.timing``), summed over them
    (``compile`` only where a trial compiled); then, where logged (``tracking.breakdown``), their
    seconds queued for a slot of the grid (summed) and the first train step after submit (the
    earliest of any trial: a submission's, when ``trials`` are one submission's)."""
    seconds: dict[str, float] = {}
    for trial in trials:
        for k, v in trial["metrics"].items():
            if k.startswith("time/"):
                seconds[k] = seconds.get(k, 0.0) + v
    total = seconds.get("time/total_s", 0.0)
    if not trials or total <= 0:
        return "time split: no finished trial has logged one yet"
    parts = ", ".join(f"{name} {seconds.get(f'time/{name}_s', 0.0):,.0f} s"
                      for name in (*PHASES, "teardown")
                      if name != "compile" or seconds.get("time/compile_s", 0.0) > 0)
    line = (f"time split of {len(trials)} finished trial(s): "
            f"{seconds.get('time/train_s', 0.0) / total:.0%} in train steps ({parts}; "
            f"{total:,.0f} s in all)")
    if "time/queue_s" in seconds:
        line += f"; before that, {seconds['time/queue_s']:,.0f} s queued for a slot of the grid"
    firsts = [t["metrics"]["time/first_step_s"] for t in trials
              if "time/first_step_s" in t["metrics"]]
    if firsts:
        line += f"; first train step {min(firsts):,.1f} s after submit"
    return line


def format_efficiency(trials: list[dict]) -> str:
    """Per (variant, size) of the ``trials`` (``tracking.finished_trials``): MFU over the train
    steps (``train_mfu``: mean, min and max) and the most memory a worker held
    (``peak_memory_mib``)."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for trial in trials:
        if "train_mfu" in trial["metrics"]:
            groups.setdefault((trial["variant"], trial["size"]), []).append(trial["metrics"])
    if not groups:
        return "MFU and peak memory: no finished trial has logged them yet"
    rows = []
    for (variant, size), ms in groups.items():
        mfu = [m["train_mfu"] for m in ms]
        rows.append({"variant": variant, "size": size, "trials": len(ms),
                     "MFU mean": f"{sum(mfu) / len(mfu):.1%}",
                     "MFU min-max": f"{min(mfu):.1%}-{max(mfu):.1%}",
                     "peak memory/worker": f"{max(m['peak_memory_mib'] for m in ms):,.0f} MiB"})
    return "MFU (model FLOPs over the devices' peak, train steps) and peak memory:\n" + (
        format_table(rows))


def format_status(spec: ExperimentSpec, rows: list[TrialRow], planned: int) -> str:
    """Progress of an experiment: counts by status, one line per trial, then the first line of
    what each failed trial raised (the whole of it is the ledger row's ``error``)."""
    head = (f"experiment {spec.name}: {planned} trial(s) planned, "
            + ", ".join(f"{n} {s.lower()}" for s, n in status_counts(rows).items())
            + f", {max(planned - len(rows), 0)} not yet submitted")
    table = [{"trial": r.trial_hash, "dataset": r.dataset, "variant": r.variant,
              "size": r.size, "lr": f"{r.lr:g}", "seed": r.seed,
              "status": f"{r.status} (cached)" if r.source_trial_id else str(r.status),
              metric_name(spec): r.metric, "mlflow run": r.mlflow_run_id,
              "updated": r.updated_at.strftime("%Y-%m-%d %H:%M:%S"),
              "checkpoint": r.checkpoint_path} for r in rows]
    failures = [f"{r.trial_hash} failed: {r.error.strip().splitlines()[0]}" for r in rows
                if r.status == Status.FAILED and r.error and r.error.strip()]
    return "\n".join([head, format_table(table), *failures]) if table else head
