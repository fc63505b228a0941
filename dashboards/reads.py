"""Every read of the dashboard, in one place, read-only and cached (``st.cache_data`` with a
short TTL): MLflow through its search API with server-side filters, and the ledger (which
decides a trial's status; MLflow only follows it). Functions take the tracking URI and ledger
URL as strings so that their results cache by value; they never write."""

from __future__ import annotations

import datetime as dt
import os
import urllib.error
import urllib.request

import pandas as pd
import streamlit as st
from mlflow import MlflowClient

TTL_S = 15  # how stale a page may be: a live grid's new results appear within this
ROLE = "tags.`cemlab.role`"
_TAGS = ["variant", "size", "dataset", "attention", "mlp", "lr", "seed", "cemlab.trial_id",
         "cemlab.exact_gradient", "mlflow.source.git.commit"]
_METRICS = ["params_total", "params_non_embedding", "params_embedding", "params_attention",
            "params_mlp", "flops_per_token", "test_perplexity", "val_perplexity",
            "unigram_test_perplexity", "test_rmse", "val_rmse", "train_mfu", "peak_memory_mib",
            "time/total_s", "time/train_s"]
RUN_COLUMNS = ["experiment", "run_id", "run_name", "mlflow_status", "status", "tokens",
               *[t.removeprefix("cemlab.") for t in _TAGS], *_METRICS, "train_flops"]


class Unreachable(RuntimeError):
    """The tracking server or the ledger cannot be read (one line: which, and how to start it)."""


def tracking_uri() -> str:
    """``$MLFLOW_TRACKING_URI`` (``make dashboard`` sets it to the local server).

    Raises:
        Unreachable: not set.
    """
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        raise Unreachable("MLFLOW_TRACKING_URI is not set: start the dashboard with "
                          "`make dashboard`, or export the tracking server's URI")
    return uri


def ledger_url() -> str:
    """The ledger's database URL (``$CEMLAB_LEDGER_URL``, else CEM Lab's default)."""
    from orchestrator.settings import Settings

    return Settings().ledger_url


def check_reachable(uri: str, timeout_s: float = 3.0) -> None:
    """Raise ``Unreachable`` (one line) when an ``http(s)://`` tracking server does not answer
    its ``/health`` within ``timeout_s``; other stores (a database URL) are read directly."""
    if not uri.startswith(("http://", "https://")):
        return
    try:
        with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout_s):
            return
    except urllib.error.HTTPError as e:
        if e.code in (401, 403):  # a server with auth answers: the client sends credentials
            return
        raise Unreachable(f"the MLflow server at {uri} answered {e.code} on /health") from None
    except (OSError, ValueError) as e:
        raise Unreachable(f"the MLflow server at {uri} does not answer ({e.__class__.__name__}"
                          f"): start it with `make up`, or set MLFLOW_TRACKING_URI") from None


@st.cache_data(ttl=TTL_S, show_spinner=False)
def experiment_names(uri: str) -> list[str]:
    """Experiments with at least one CEM Lab trial run, most recently created first."""
    client = MlflowClient(uri)
    exps = client.search_experiments(order_by=["creation_time DESC"])
    return [e.name for e in exps
            if client.search_runs([e.experiment_id], f"{ROLE} = 'trial'", max_results=1)]


def _run_row(experiment: str, run, statuses: dict[str, str]) -> dict:
    tags, metrics, params = run.data.tags, run.data.metrics, run.data.params
    tokens = float(params["tokens"]) if "tokens" in params else None
    flops = metrics.get("flops_per_token")
    return {"experiment": experiment, "run_id": run.info.run_id,
            "run_name": run.info.run_name, "mlflow_status": run.info.status,
            "status": statuses.get(run.info.run_id), "tokens": tokens,
            **{t.removeprefix("cemlab."): tags.get(t) for t in _TAGS},
            **{m: metrics.get(m) for m in _METRICS},
            "train_flops": flops * tokens if flops is not None and tokens else None}


@st.cache_data(ttl=TTL_S, show_spinner=False)
def trial_runs(uri: str, ledger: str, experiments: tuple[str, ...]) -> pd.DataFrame:
    """One row per trial run of ``experiments`` (never their parent runs), ``RUN_COLUMNS``:
    tags (``lr`` a float, ``seed`` an int), final metrics, ``tokens`` (the trial's budget),
    ``train_flops`` (``flops_per_token`` x tokens, analytic) and ``status`` (the ledger's)."""
    client = MlflowClient(uri)
    rows = []
    for name in experiments:
        exp = client.get_experiment_by_name(name)
        if exp is None:
            continue
        statuses = trial_statuses(ledger, name)
        runs = client.search_runs([exp.experiment_id], f"{ROLE} = 'trial'",
                                  max_results=50_000)
        rows += [_run_row(name, r, statuses) for r in runs]
    frame = pd.DataFrame(rows, columns=RUN_COLUMNS)
    frame["lr"] = pd.to_numeric(frame["lr"])
    frame["seed"] = pd.to_numeric(frame["seed"]).astype("Int64")
    return frame


@st.cache_data(ttl=TTL_S, show_spinner=False)
def trial_statuses(ledger: str, experiment: str) -> dict[str, str]:
    """``{mlflow run id: ledger status}`` of the experiment's trials, the ledger opened without
    migrating (it never creates a table); empty when the ledger lacks the experiment."""
    return {r["mlflow_run_id"]: r["status"] for r in ledger_trials(ledger, experiment)
            if r["mlflow_run_id"]}


def _ledger(url: str):
    from orchestrator.ledger import Ledger

    return Ledger(url, migrate=False, retry_deadline_s=5)  # a page waits 5 s at most


@st.cache_data(ttl=TTL_S, show_spinner=False)
def ledger_trials(ledger: str, experiment: str) -> list[dict]:
    """The experiment's ledger rows as dicts (status a plain string)."""
    led = _ledger(ledger)
    exp = led.experiment(experiment)
    return [{"trial": r.trial_hash, "dataset": r.dataset, "variant": r.variant,
             "size": r.size, "lr": r.lr, "seed": r.seed, "status": str(r.status),
             "mlflow_run_id": r.mlflow_run_id, "error": r.error, "started_at": r.started_at,
             "finished_at": r.finished_at, "updated_at": r.updated_at}
            for r in (led.trials(exp.id) if exp else [])]


@st.cache_data(ttl=TTL_S, show_spinner=False)
def ledger_experiments(ledger: str) -> list[dict]:
    """Every experiment the ledger knows: name, workload, MLflow ids, creation time."""
    return [{"name": e.name, "workload": e.workload, "mlflow_experiment_id":
             e.mlflow_experiment_id, "parent_run_id": e.parent_run_id,
             "created_at": e.created_at} for e in _ledger(ledger).experiments()]


@st.cache_data(ttl=TTL_S, show_spinner=False)
def metric_histories(uri: str, run_ids: tuple[str, ...], keys: tuple[str, ...]) -> pd.DataFrame:
    """Columns ``run_id, key, step, value`` of every metric ``keys`` over ``run_ids``."""
    client = MlflowClient(uri)
    rows = [{"run_id": rid, "key": key, "step": m.step, "value": m.value}
            for rid in run_ids for key in keys for m in client.get_metric_history(rid, key)]
    return pd.DataFrame(rows, columns=["run_id", "key", "step", "value"])


DIAGNOSTICS = ("energy", "energy_fell", "descent", "update_norm", "attn_entropy")


@st.cache_data(ttl=TTL_S, show_spinner=False)
def diagnostics(uri: str, run_id: str) -> pd.DataFrame:
    """A run's latest energy diagnostics (``workloads.models.diagnostics``): columns ``kind``
    (one of ``DIAGNOSTICS``), ``sublayer, layer, step, value``; empty without diagnostics."""
    rows = []
    for key, value in MlflowClient(uri).get_run(run_id).data.metrics.items():
        parts = key.split("/")
        if len(parts) == 4 and parts[0] in DIAGNOSTICS:
            rows.append({"kind": parts[0], "sublayer": parts[1],
                         "layer": int(parts[2].removeprefix("layer")),
                         "step": int(parts[3].removeprefix("step")), "value": value})
    return pd.DataFrame(rows, columns=["kind", "sublayer", "layer", "step", "value"]).sort_values(
        ["kind", "sublayer", "layer", "step"], ignore_index=True)


@st.cache_data(ttl=TTL_S, show_spinner=False)
def registry_versions(uri: str) -> pd.DataFrame:
    """Every version of every registered CEM Lab model (``cemlab-*``): name, version, aliases,
    its tags (trial, perplexities, parameters, tokens, data), the last ``models eval`` result
    (``test_perplexity_recomputed``) and when it was registered."""
    client = MlflowClient(uri)
    aliases: dict[tuple[str, str], list[str]] = {}
    for m in client.search_registered_models("name LIKE 'cemlab-%'", max_results=1000):
        for alias, version in m.aliases.items():  # versions found by search carry none
            aliases.setdefault((m.name, str(version)), []).append(alias)
    rows = []
    for v in client.search_model_versions("name LIKE 'cemlab-%'", max_results=10_000):
        t = v.tags
        rows.append({"model": v.name, "version": int(v.version), "aliases": ", ".join(
                         sorted(aliases.get((v.name, str(v.version)), []))),
                     "variant": t.get("variant"),
                     "size": t.get("size"), "experiment": t.get("experiment"),
                     "trial": t.get("trial_id"), "lr": _num(t.get("lr")),
                     "val perplexity": _num(t.get("val_perplexity")),
                     "test perplexity": _num(t.get("test_perplexity")),
                     "eval: test perplexity": _num(t.get("test_perplexity_recomputed")),
                     "params": _num(t.get("params_total")),
                     "non-emb params": _num(t.get("params_non_embedding")),
                     "tokens": _num(t.get("tokens")), "data": t.get("data"),
                     "registered (UTC)": dt.datetime.fromtimestamp(
                         v.creation_timestamp / 1000, dt.UTC).replace(tzinfo=None),
                     "run_id": v.run_id})
    columns = ["model", "version", "aliases", "variant", "size", "experiment", "trial", "lr",
               "val perplexity", "test perplexity", "eval: test perplexity", "params",
               "non-emb params", "tokens", "data", "registered (UTC)", "run_id"]
    return pd.DataFrame(rows, columns=columns).sort_values(["model", "version"],
                                                          ignore_index=True)


def _num(value: str | None) -> float | None:
    return float(value) if value not in (None, "") else None
