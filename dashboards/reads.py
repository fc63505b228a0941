"""Every read of the dashboard, in one place, read-only and cached (``st.cache_data`` with a
short TTL). The ledger gives each trial's coordinates, status and metrics (it decides them;
MLflow only follows); MLflow, through its search API with server-side filters, gives what the
ledger lacks: one run per (dataset, variant, size) for what its trials share (parameters,
FLOPs, tokens), a sample of finished runs for the FLOP/s rate, metric histories, diagnostics
and the registry. Never a download of every run: 1,000 of them take seconds to read.
A trial imported from a result bundle (``cemlab import``) has no MLflow run here: what its run
held (parameters, FLOPs, tokens, test-time evaluations) is read from the bundle itself
(``bundle_trials``, in the directories of ``bundle_dirs``), never copied anywhere.
Functions take the tracking URI, ledger URL and bundle directories as strings so that their
results cache by value; they never write."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import streamlit as st
from mlflow import MlflowClient

TTL_S = 15  # how stale a page may be: a live grid's new results appear within this
ROLE = "tags.`cemlab.role`"
RATE_SAMPLE = 20  # finished runs an experiment's FLOP/s rate is measured on (the newest)
_SHARED = ["attention", "mlp", "exact_gradient", "params_total", "params_non_embedding",
           "params_embedding", "params_attention", "params_mlp", "flops_per_token", "tokens",
           "steps"]
RUN_COLUMNS = ["experiment", "run_id", "run_name", "status", "dataset", "variant", "size", "lr",
               "seed", "trial", "test_perplexity", "val_perplexity", "test_rmse", "val_rmse",
               *_SHARED, "position", "train_flops", "source"]
# where a trial's run data comes from (column ``source``): its MLflow run here, the result
# bundle it was imported from, or neither (the ledger's row alone: coordinates and metrics)
SOURCES = ("mlflow", "bundle", "ledger")
BUNDLES_ENV = "CEMLAB_BUNDLES"
COMMITTED_BUNDLES = Path(__file__).resolve().parents[1] / "docs" / "results" / "data"


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


def bundle_dirs() -> tuple[str, ...]:
    """Where the result bundles of imported trials are read from: the paths of
    ``$CEMLAB_BUNDLES`` (separated by ``os.pathsep``; set but empty: none), else the
    repository's committed results (``docs/results/data``) where that directory exists. Each
    path is a bundle or a directory of bundles (``orchestrator.records.bundles.find_bundles``)."""
    value = os.environ.get(BUNDLES_ENV)
    if value is not None:
        return tuple(p for p in value.split(os.pathsep) if p)
    return (str(COMMITTED_BUNDLES),) if COMMITTED_BUNDLES.is_dir() else ()


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
def experiment_names(ledger: str, workload: str | None = None) -> list[str]:
    """The ledger's experiments that have trials (of ``workload`` only, when given), most
    recently created first."""
    return [e["name"] for e in sorted(ledger_experiments(ledger), key=lambda e: e["created_at"],
                                      reverse=True)
            if ledger_trials(ledger, e["name"]) and workload in (None, e["workload"])]


def _quoted(value: str) -> str:
    """``value`` as a string literal of MLflow's search grammar."""
    if "'" in value:
        raise ValueError(f"a name with a quote cannot be searched for: {value!r}")
    return f"'{value}'"


def _shared(run) -> dict:
    """What a trial run shares with every trial of its (dataset, variant, size)."""
    return shared_of(run.data.tags, run.data.params, run.data.metrics)


def shared_of(tags: dict[str, str], params: dict[str, str], metrics: dict[str, float]) -> dict:
    """What a trial shares with every trial of its (dataset, variant, size), from its run's
    ``tags`` (``attention``, ``mlp``, ``cemlab.exact_gradient``), ``params`` (strings, as
    MLflow holds them) and ``metrics`` (the last value of each): the keys of ``_SHARED`` and
    ``position``; parameter counts and ``flops_per_token`` as logged (counts; FLOPs per token),
    ``tokens`` and ``steps`` as floats, None where the run lacks one."""
    return {"attention": tags.get("attention"), "mlp": tags.get("mlp"),
            "position": params.get("model.position"),
            "exact_gradient": tags.get("cemlab.exact_gradient"),
            **{k: metrics.get(k) for k in _SHARED[3:-2]},
            **{k: float(params[p]) if p in params else None
               for k, p in (("tokens", "tokens"), ("steps", "training.steps"))}}


def group_info(client: MlflowClient, experiment_id: str, trials: list[dict]) -> dict:
    """``{(dataset, variant, size): shared}`` for the groups of ``trials`` (ledger rows):
    sublayer kinds, ``exact_gradient``, parameter counts, ``flops_per_token``, ``tokens`` (the
    budget) and ``steps``, read from MLflow trial runs found by server-side filters, never a
    download of the grid. One search takes the runs of the (lr, seed) most groups have, one
    run per group; a group it missed gets a search of its own. Groups MLflow has no run of
    are left out."""
    groups = {(r["dataset"], r["variant"], r["size"]) for r in trials}
    if not groups:
        return {}
    lr, seed = Counter((r["lr"], r["seed"]) for r in trials).most_common(1)[0][0]
    info: dict[tuple[str, str, str], dict] = {}
    found = client.search_runs([experiment_id], f"{ROLE} = 'trial' and tags.lr = '{lr:g}' and "
                               f"tags.seed = '{seed}'", max_results=10 * len(groups))
    for group in sorted(groups):
        runs = [r for r in found if (r.data.tags.get("dataset"), r.data.tags.get("variant"),
                                     r.data.tags.get("size")) == group]
        runs = runs or client.search_runs(
            [experiment_id], f"{ROLE} = 'trial' and tags.dataset = {_quoted(group[0])} and "
            f"tags.variant = {_quoted(group[1])} and tags.size = {_quoted(group[2])}",
            max_results=1, order_by=["attributes.start_time DESC"])
        if runs:
            info[group] = _shared(runs[0])
    return info


@st.cache_data(ttl=TTL_S, show_spinner=False)
def experiment_trials(ledger: str, uri: str, experiment: str,
                      bundles: tuple[str, ...] = ()) -> pd.DataFrame:
    """One row per trial of ``experiment``, ``RUN_COLUMNS``: the ledger's coordinates, status
    and metrics (test and validation, under the workload's names), and what its (dataset,
    variant, size) shares (``group_info``; for a group MLflow has no run of, a trial of it
    that the result bundles in ``bundles`` hold, ``bundle_trials``), with ``train_flops``
    (analytic ``flops_per_token`` x tokens). ``run_id`` is the trial's MLflow run (None before
    it has one, and for a trial imported from a bundle); ``source`` (one of ``SOURCES``) says
    where its run's data is read from. Bundles are read only when a trial has no run."""
    workload = next((e["workload"] for e in ledger_experiments(ledger)
                     if e["name"] == experiment), None)
    test = "test_rmse" if workload == "gp_regression" else "test_perplexity"
    val = test.replace("test_", "val_")
    trials = ledger_trials(ledger, experiment)
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    info = group_info(client, exp.experiment_id, trials) if exp else {}
    runless = [r for r in trials if not r["mlflow_run_id"]]
    held = bundle_trials(bundles).trials if bundles and runless else {}
    imported = {r["trial"]: held[r["trial"]]["shared"] for r in runless
                if r["trial"] in held and held[r["trial"]]["shared"]}
    for r in runless:
        if r["trial"] in imported:
            info.setdefault((r["dataset"], r["variant"], r["size"]), imported[r["trial"]])
    rows = []
    for r in trials:
        shared = info.get((r["dataset"], r["variant"], r["size"]), {})
        flops, tokens = shared.get("flops_per_token"), shared.get("tokens")
        source = "mlflow" if r["mlflow_run_id"] else (
            "bundle" if r["trial"] in imported else "ledger")
        rows.append({"experiment": experiment, "run_id": r["mlflow_run_id"],
                     "run_name": f"{r['variant']}@{r['size']} lr={r['lr']:g} seed={r['seed']}",
                     **{k: r[k] for k in ("status", "dataset", "variant", "size", "lr", "seed",
                                          "trial")},
                     test: r["metric"], val: r["val_metric"], **shared,
                     "train_flops": flops * tokens if flops and tokens else None,
                     "source": source})
    frame = pd.DataFrame(rows, columns=RUN_COLUMNS)
    numeric = ["lr", *_SHARED[3:], "train_flops", test, val]
    frame[numeric] = frame[numeric].apply(pd.to_numeric)
    frame["seed"] = pd.to_numeric(frame["seed"]).astype("Int64")
    return frame


def trial_runs(ledger: str, uri: str, experiments: tuple[str, ...],
               bundles: tuple[str, ...] = ()) -> pd.DataFrame:
    """``experiment_trials`` of every experiment of ``experiments`` (imported trials read from
    the result bundles in ``bundles``), one frame."""
    frames = [experiment_trials(ledger, uri, name, bundles) for name in experiments]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(
        columns=RUN_COLUMNS)


@dataclass(frozen=True)
class Held:
    """What result bundles hold of their trials' MLflow runs (``bundle_trials``).

    ``trials``: trial id -> ``{"bundle": its directory, "shared": shared_of its run (None
    where the bundle was exported without MLflow), "test_time": [(t_eval, rule, perplexity)],
    "t_train": int}`` (``recursion_rows``, ``trained_steps``); a trial id in several bundles is
    the same science, and the first bundle read gives it. ``bundles``: the bundle directories
    read, in order; ``unread``: one line for each path that gave no bundle, and why."""

    trials: dict[str, dict]
    bundles: tuple[str, ...]
    unread: tuple[str, ...]


def recursion_rows(metrics: dict[str, float]) -> list[tuple[int, str, float]]:
    """``(t_eval, rule, perplexity)`` of every test-time recursion metric among a run's
    ``metrics`` (``test_time/T<t_eval>_<rule>/perplexity``, ``rule`` ``kept`` or ``scaled``),
    in the order of ``metrics``."""
    return [(int(found[1]), found[2], float(value)) for key, value in metrics.items()
            if (found := TEST_TIME.match(key))]


def trained_steps(kinds: dict[str, str | None], params: dict[str, str]) -> int:
    """The recursion steps a trial's CEM sublayers trained at: ``model.attn_steps`` and
    ``model.mlp_steps`` of ``params`` for the sublayers whose kind in ``kinds`` (``attention``,
    ``mlp``) is ``cem``; 0 where they differ, or where it has no CEM sublayer."""
    trained = {int(params.get(f"model.{sub}_steps", 0))
               for sub, kind in (("attn", "attention"), ("mlp", "mlp"))
               if kinds.get(kind) == "cem"}
    return trained.pop() if len(trained) == 1 else 0


@st.cache_data(ttl=TTL_S, show_spinner=False)
def bundle_trials(directories: tuple[str, ...]) -> Held:
    """The trials of every result bundle found in ``directories`` (each a bundle or a
    directory of bundles, ``orchestrator.records.bundles.find_bundles``), each bundle verified
    (``read_bundle``: checksums, row counts) before any row of it is used; a path that gives
    no verified bundle is skipped and named in ``Held.unread``."""
    from orchestrator.records import bundles

    trials: dict[str, dict] = {}
    read, unread = [], []
    for path in directories:
        found = bundles.find_bundles(Path(path))
        if not found:
            unread.append(f"{path}: no bundle ({bundles.MANIFEST} not found there or one "
                          "directory below)")
        for directory in found:
            try:
                bundle = bundles.read_bundle(directory)
            except bundles.BundleError as e:
                unread.append(str(e))
                continue
            read.append(str(directory))
            for t in bundle.trials:
                params = json.loads(t["params"]) if t["params"] else None
                metrics = json.loads(t["metrics"]) if t["metrics"] else {}
                kinds = {"attention": params.get("model.attention"),
                         "mlp": params.get("model.mlp")} if params else {}
                trials.setdefault(t["trial_hash"], {
                    "bundle": str(directory),
                    "shared": shared_of(kinds, params, metrics) if params else None,
                    "test_time": recursion_rows(metrics),
                    "t_train": trained_steps(kinds, params or {})})
    return Held(trials, tuple(read), tuple(unread))


@st.cache_data(ttl=TTL_S, show_spinner=False)
def train_rate(uri: str, experiment: str) -> tuple[float, float]:
    """``(FLOPs, seconds)`` of the train steps of the experiment's newest ``RATE_SAMPLE``
    finished trial runs (analytic ``flops_per_token`` x tokens, ``time/train_s``): their ratio
    is the FLOP/s its trials achieve here. ``(0, 0)`` before one has finished."""
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id], f"{ROLE} = 'trial' and "
                              "metrics.`time/train_s` > 0", max_results=RATE_SAMPLE,
                              order_by=["attributes.start_time DESC"]) if exp else []
    flops = seconds = 0.0
    for run in runs:
        per_token, tokens = run.data.metrics.get("flops_per_token"), run.data.params.get("tokens")
        if per_token and tokens:
            flops += per_token * float(tokens)
            seconds += run.data.metrics["time/train_s"]
    return flops, seconds


@st.cache_data(ttl=TTL_S, show_spinner=False)
def time_metrics(uri: str, experiment: str) -> list[dict[str, float]]:
    """The ``time/*`` metrics (seconds, ``orchestrator.records.tracking.breakdown``) of every
    finished trial run of ``experiment``: the runs that logged ``time/total_s`` (a trial copied
    from another experiment's logs 0 there and no phase)."""
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id], f"{ROLE} = 'trial' and "
                              "metrics.`time/total_s` >= 0", max_results=50_000) if exp else []
    return [{k: v for k, v in run.data.metrics.items() if k.startswith("time/")}
            for run in runs]


def _ledger(url: str):
    from orchestrator.records.ledger import Ledger

    return Ledger(url, migrate=False, retry_deadline_s=5)  # a page waits 5 s at most


@st.cache_data(ttl=TTL_S, show_spinner=False)
def ledger_trials(ledger: str, experiment: str) -> list[dict]:
    """The experiment's ledger rows as dicts (status a plain string)."""
    led = _ledger(ledger)
    exp = led.experiment(experiment)
    return [{"trial": r.trial_hash, "dataset": r.dataset, "variant": r.variant,
             "size": r.size, "lr": r.lr, "seed": r.seed, "status": str(r.status),
             "metric": r.metric, "val_metric": r.val_metric,
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


TEST_TIME = re.compile(r"^test_time/T(\d+)_(kept|scaled)/perplexity$")
TEST_TIME_COLUMNS = ["t_eval", "rule", "perplexity", "t_train"]


@st.cache_data(ttl=TTL_S, show_spinner=False)
def recursion_perplexities(uri: str, run_ids: tuple[str, ...]) -> pd.DataFrame:
    """The test-time recursion perplexities (``training.eval_steps``,
    ``workloads.lm.recursion``) of the runs ``run_ids``: columns ``run_id, t_eval, rule``
    (``kept``: eta per step as trained; ``scaled``: eta x T_train / T_eval), ``perplexity``
    and ``t_train`` (the steps its CEM sublayers trained at; 0 where they differ, and no
    setting is the model as trained); empty where none logged them."""
    client = MlflowClient(uri)
    rows = []
    for run_id in run_ids:
        run = client.get_run(run_id)
        t_train = trained_steps(run.data.tags, run.data.params)
        rows += [{"run_id": run_id, "t_eval": t_eval, "rule": rule, "perplexity": value,
                  "t_train": t_train}
                 for t_eval, rule, value in recursion_rows(run.data.metrics)]
    return pd.DataFrame(rows, columns=["run_id", *TEST_TIME_COLUMNS]).sort_values(
        ["run_id", "rule", "t_eval"], ignore_index=True)


def trial_recursion_perplexities(uri: str, bundles: tuple[str, ...],
                           trials: tuple[tuple[str, str | None], ...]) -> pd.DataFrame:
    """The test-time recursion perplexities of ``trials`` (``(trial id, MLflow run id or
    None)``): from its MLflow run where it has one (``recursion_perplexities``), else from the
    result bundle in ``bundles`` that holds it (``bundle_trials``). Columns ``trial``, then
    those of ``recursion_perplexities`` but ``run_id``, sorted by trial, rule and T_eval;
    empty where none was evaluated so."""
    by_run = {run_id: trial for trial, run_id in trials if run_id}
    logged = recursion_perplexities(uri, tuple(by_run)) if by_run else pd.DataFrame(
        columns=["run_id", *TEST_TIME_COLUMNS])
    frames = [logged.assign(trial=logged["run_id"].map(by_run)).drop(columns="run_id")]
    imported = [trial for trial, run_id in trials if not run_id]
    held = bundle_trials(bundles).trials if imported and bundles else {}
    rows = [{"trial": trial, "t_eval": t_eval, "rule": rule, "perplexity": value,
             "t_train": held[trial]["t_train"]}
            for trial in imported if trial in held
            for t_eval, rule, value in held[trial]["test_time"]]
    frames = [f for f in (*frames, pd.DataFrame(rows, columns=["trial", *TEST_TIME_COLUMNS]))
              if not f.empty]
    frame = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(
        columns=["trial", *TEST_TIME_COLUMNS])
    return frame[["trial", *TEST_TIME_COLUMNS]].sort_values(
        ["trial", "rule", "t_eval"], ignore_index=True)


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
