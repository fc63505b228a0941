"""Every read of the dashboard, in one place (read-only): MLflow for runs and metrics, the
ledger for trial status (the ledger decides a trial's status; MLflow only follows it)."""

from __future__ import annotations

import os

import pandas as pd
from mlflow import MlflowClient

_TAGS = ["variant", "size", "attention", "mlp", "lr", "seed"]
RUN_COLUMNS = ["run_id", "run_name", "status", *_TAGS,
               "params_total", "params_embedding", "params_attention", "params_mlp",
               "tokens_seen", "val_perplexity", "test_perplexity", "unigram_test_perplexity",
               "train_wall_s"]
OPTIMA_COLUMNS = ["dataset", "variant", "size", "opt_lr", "opt_perplexity"]


def trial_statuses(experiment_name: str) -> dict[str, str]:
    """``{mlflow run id: ledger status}`` of the experiment's trials, from the ledger at
    ``$CEMLAB_LEDGER_URL`` (``make dashboard`` sets it), opened read-only; empty when the
    ledger has no such experiment (or no tables yet)."""
    from orchestrator.ledger import Ledger
    from orchestrator.settings import Settings

    ledger = Ledger(Settings().ledger_url, migrate=False, retry_deadline_s=5)  # a page waits
    exp = ledger.experiment(experiment_name)
    return {r.mlflow_run_id: str(r.status) for r in (ledger.trials(exp.id) if exp else [])
            if r.mlflow_run_id}


def tracking_uri() -> str:
    """``$MLFLOW_TRACKING_URI``; ``make dashboard`` sets it to the local server."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        raise RuntimeError("MLFLOW_TRACKING_URI is not set (run `make dashboard`, or export it)")
    return uri


def experiment_names(client: MlflowClient) -> list[str]:
    """Experiments with at least one run, most recently created first."""
    exps = client.search_experiments(order_by=["creation_time DESC"])
    return [e.name for e in exps
            if client.search_runs([e.experiment_id], max_results=1)]


def _runs(client: MlflowClient, experiment_name: str, role: str) -> list:
    exp = client.get_experiment_by_name(experiment_name)
    if exp is None:
        return []
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])
    return [r for r in runs if r.data.tags.get("cemlab.role", "trial") == role]


def runs_frame(client: MlflowClient, experiment_name: str,
               statuses: dict[str, str]) -> pd.DataFrame:
    """One row per trial run of the experiment (not its parent run), with ``RUN_COLUMNS``
    (missing values are NaN; ``lr`` a float); ``status`` from ``statuses`` (the ledger's,
    ``trial_statuses``), None for a run the ledger does not know."""
    rows = []
    for run in _runs(client, experiment_name, "trial"):
        tags, metrics = run.data.tags, run.data.metrics
        rows.append({"run_id": run.info.run_id, "run_name": run.info.run_name,
                     "status": statuses.get(run.info.run_id), **{k: tags.get(k) for k in _TAGS},
                     **{k: metrics.get(k) for k in RUN_COLUMNS[3 + len(_TAGS):]}})
    frame = pd.DataFrame(rows, columns=RUN_COLUMNS)
    frame["lr"] = pd.to_numeric(frame["lr"])
    return frame


def optima_frame(client: MlflowClient, experiment_name: str) -> pd.DataFrame:
    """The Akima optima stored on the experiment's parent run (metrics
    ``<dataset>/<variant>/<size>/opt_lr`` and ``.../opt_perplexity``), ``OPTIMA_COLUMNS``."""
    rows: dict[tuple, dict] = {}
    for run in _runs(client, experiment_name, "experiment"):
        for key, value in run.data.metrics.items():
            parts = key.split("/")
            if len(parts) == 4 and parts[3] in ("opt_lr", "opt_perplexity"):
                rows.setdefault(tuple(parts[:3]), dict(zip(OPTIMA_COLUMNS, parts[:3])))[
                    parts[3]] = value
    return pd.DataFrame(list(rows.values()), columns=OPTIMA_COLUMNS)


def energy_frame(client: MlflowClient, run_id: str) -> pd.DataFrame:
    """Latest energy diagnostics of a run: columns ``sublayer, layer, step, energy``.

    Reads the ``energy/{attn,mlp}/layer{l}/step{t}`` metrics (empty without diagnostics).
    """
    rows = []
    for key, value in client.get_run(run_id).data.metrics.items():
        parts = key.split("/")
        if len(parts) == 4 and parts[0] == "energy":
            rows.append({"sublayer": parts[1], "layer": int(parts[2].removeprefix("layer")),
                         "step": int(parts[3].removeprefix("step")), "energy": value})
    return pd.DataFrame(rows, columns=["sublayer", "layer", "step", "energy"]).sort_values(
        ["sublayer", "layer", "step"], ignore_index=True)


def metric_history(client: MlflowClient, run_ids: list[str], key: str) -> pd.DataFrame:
    """Columns ``run_id, step, value`` of metric ``key`` over the given runs."""
    rows = [{"run_id": rid, "step": m.step, "value": m.value}
            for rid in run_ids for m in client.get_metric_history(rid, key)]
    return pd.DataFrame(rows, columns=["run_id", "step", "value"])
