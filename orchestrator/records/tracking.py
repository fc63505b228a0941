"""MLflow bookkeeping of the driver: one experiment and one parent run per spec, one nested run
per trial. A run's status follows its trial's status in the ledger (``mirror_status``)."""

from __future__ import annotations

import time
from typing import Any

from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunStatus
from mlflow.exceptions import MlflowException

from orchestrator.planning.spec import ExperimentSpec
from orchestrator.records.ledger import Status
from workloads.core.provenance import code_fingerprint, git_commit
from workloads.core.trial import PHASES, Trial

TRIAL_TAG = "cemlab.trial_id"
ROLE_TAG = "cemlab.role"  # "experiment" (the parent run) or "trial"
PARENT_TAG = "mlflow.parentRunId"  # MLflow's own nesting tag
COMMIT_TAG = "mlflow.source.git.commit"  # MLflow's own: the UI shows it as the run's source
SECTIONS = ("training", "optimizer", "schedule", "engine", "resources")  # a trial's, as params
LR_ROUND_TAG = "cemlab.lr_round"  # on a trial an adapting bracket added: its round, from 1
CODE_TAG = "cemlab.code"  # provenance.code_fingerprint(), part of every trial id


def provenance_tags() -> dict[str, str]:
    """The commit this code runs from (when known) and the fingerprint of its science code."""
    commit = git_commit()
    return {CODE_TAG: code_fingerprint(), **({COMMIT_TAG: commit} if commit else {})}

_RUN_STATUS = {Status.PENDING: RunStatus.SCHEDULED, Status.RUNNING: RunStatus.RUNNING,
               Status.FINISHED: RunStatus.FINISHED, Status.FAILED: RunStatus.FAILED}


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def experiment_id(client: MlflowClient, name: str) -> str:
    """The id of MLflow experiment ``name``, created if missing."""
    exp = client.get_experiment_by_name(name)
    if exp:
        return exp.experiment_id
    try:
        return client.create_experiment(name)
    except MlflowException as e:  # a concurrent submission created it since we looked
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        return client.get_experiment_by_name(name).experiment_id


def start_parent_run(client: MlflowClient, exp_id: str, spec: ExperimentSpec,
                     spec_yaml: str) -> str:
    """Create the experiment's parent run: the spec as artifact ``spec.yaml``, the grid axes as
    params, ``provenance_tags``. Returns its run id."""
    run = client.create_run(exp_id, run_name=spec.name, tags={
        ROLE_TAG: "experiment", "workload": spec.workload, **provenance_tags()})
    datasets = spec.workload_impl.datasets(spec.workload_config)
    axes = {"sizes": ",".join(spec.sizes), "variants": ",".join(spec.variants),
            "learning_rates": ",".join(f"{lr:g}" for lr in spec.lr_grid),
            "seeds": ",".join(map(str, spec.seeds)), "datasets": ",".join(datasets),
            **({"lr_max_points": str(spec.lr_max_points)} if spec.lr_max_points else {})}
    client.log_batch(run.info.run_id, params=[Param(k, v) for k, v in axes.items()])
    client.log_text(run.info.run_id, spec_yaml, "spec.yaml")
    return run.info.run_id


def find_trial_run(client: MlflowClient, exp_id: str, trial_id: str) -> str | None:
    """The id of an existing run of trial ``trial_id`` in ``exp_id`` (one created just before a
    crash kept the ledger from recording it), or None."""
    runs = client.search_runs([exp_id], f"tags.`{TRIAL_TAG}` = '{trial_id}'", max_results=1)
    return runs[0].info.run_id if runs else None


def start_trial_run(client: MlflowClient, exp_id: str, parent_run_id: str, trial: Trial,
                    section: str, extra_metrics: dict[str, float], lr_round: int = 0) -> str:
    """Create the trial's run, nested under the parent, with its resolved config as params and
    its parameter counts.

    Params: ``model.*`` (the resolved ``ModelConfig``), the workload's ``section`` (``data.*``
    or ``gp.*``), ``training.*``, ``optimizer.*``, ``schedule.*``, ``engine.*``,
    ``resources.*``, ``lr``, ``seed``, ``dataset``, ``tokens``, the
    steps and batch geometry. Tags: the trial's coordinates, ``cemlab.exact_gradient``
    (``false`` when its CEM attention steps are not the exact energy gradient,
    ``ModelConfig.exact_gradient``), ``provenance_tags`` (commit, code fingerprint), and for a
    learning rate that an adapting bracket added, ``cemlab.lr_round`` (``lr_round``: 1 for the
    first round beyond the grid). Metrics at step 0: ``params_<role>`` for every role of
    ``Trial.params``, ``flops_per_token`` (per example for GP; training, analytic), plus
    ``extra_metrics``.
    Returns the run id.
    """
    tags = {TRIAL_TAG: trial.trial_id, ROLE_TAG: "trial", PARENT_TAG: parent_run_id,
            "variant": trial.variant, "size": trial.size, "dataset": trial.dataset,
            "lr": f"{trial.lr:g}", "seed": str(trial.seed),
            "attention": trial.model.attention, "mlp": trial.model.mlp,
            "cemlab.exact_gradient": str(trial.model.exact_gradient).lower(),
            **provenance_tags(),
            **({LR_ROUND_TAG: str(lr_round)} if lr_round else {})}
    run = client.create_run(exp_id, run_name=trial.label, tags=tags)
    params = flatten({"model": trial.model.to_dict(), section: trial.config.model_dump(),
                      **{name: getattr(trial, name).model_dump() for name in SECTIONS}})
    params.update({"trial_id": trial.trial_id, "training.steps": trial.steps, "lr": trial.lr,
                   "seed": trial.seed, "dataset": trial.dataset, "tokens": trial.tokens,
                   "training.micro_batch": trial.micro_batch_size,
                   "training.grad_accum": trial.grad_accum})
    now = int(time.time() * 1000)
    metrics = [Metric(f"params_{k}", float(v), now, 0) for k, v in trial.params.items()]
    metrics.append(Metric("flops_per_token", trial.budget.flops / trial.tokens, now, 0))
    metrics += [Metric(k, float(v), now, 0) for k, v in extra_metrics.items()]
    client.log_batch(run.info.run_id, metrics=metrics,
                     params=[Param(k, str(v)) for k, v in params.items()])
    return run.info.run_id


CACHED_FROM_TAG = "cemlab.cached_from"  # on a trial run copied from the run that trained it
_BATCH = 1000  # MLflow's limit of entries per log_batch call (100 of them params or tags)


def copy_trial_run(client: MlflowClient, exp_id: str, parent_run_id: str,
                   source_run_id: str) -> str:
    """A FINISHED run of experiment ``exp_id``, nested under ``parent_run_id``, holding the
    trial run ``source_run_id`` of another experiment (the trial cache): its tags, params and
    every metric's whole history, but no ``time/*`` phases (this experiment spent nothing on
    it: ``time/total_s`` is 0, so sums of time and compute count the trial once, where it
    trained), and ``cemlab.cached_from`` naming the source run. Its artifacts (checkpoints,
    the model) stay with the source run. A copy that an earlier call finished is returned as it
    is; one that it left unfinished (a crash) is deleted and made again. Returns the run id."""
    source = client.get_run(source_run_id)
    trial_id = source.data.tags[TRIAL_TAG]
    for run in client.search_runs([exp_id], f"tags.`{TRIAL_TAG}` = '{trial_id}' and "
                                  f"tags.`{CACHED_FROM_TAG}` = '{source_run_id}'"):
        if run.info.status == RunStatus.to_string(RunStatus.FINISHED):
            return run.info.run_id
        client.delete_run(run.info.run_id)
    tags = {k: v for k, v in source.data.tags.items()
            if not k.startswith("mlflow.") or k == COMMIT_TAG}
    tags.update({PARENT_TAG: parent_run_id, CACHED_FROM_TAG: source_run_id})
    run_id = client.create_run(exp_id, run_name=source.info.run_name, tags=tags).info.run_id
    params = [Param(k, v) for k, v in source.data.params.items()]
    for i in range(0, len(params), 100):
        client.log_batch(run_id, params=params[i:i + 100])
    metrics = [m for key in source.data.metrics if not key.startswith("time/")
               for m in client.get_metric_history(source_run_id, key)]
    metrics.append(Metric("time/total_s", 0.0, int(time.time() * 1000), 0))
    for i in range(0, len(metrics), _BATCH):
        client.log_batch(run_id, metrics=metrics[i:i + _BATCH])
    client.set_terminated(run_id, RunStatus.to_string(RunStatus.FINISHED))
    return run_id


def breakdown(reported: dict[str, float], started_at: float, ended_at: float,
              queued_at: float | None = None, submitted_at: float | None = None,
              ) -> dict[str, float]:
    """The worker's ``reported`` phases (``workloads.core.trial.PHASES``) plus ``time/total_s``
    (``ended_at - started_at``, UNIX seconds) and ``time/teardown_s``: the rest of the total
    (the final checkpoint, the model upload, stopping the workers), never negative.

    Outside the total, with ``queued_at`` (when the submission handed the trial to Ray Tune):
    ``time/queue_s``, its wait for a slot of the grid until ``started_at`` (its driver handed it
    to Ray Train); with ``submitted_at`` (when its submission started): ``time/first_step_s``,
    from then to its first train step (``started_at`` plus its startup)."""
    parts = {f"time/{k}_s": float(reported.get(f"time/{k}_s", 0.0)) for k in PHASES}
    total = ended_at - started_at
    out = {**parts, "time/teardown_s": max(0.0, total - sum(parts.values())),
           "time/total_s": total}
    if queued_at is not None:
        out["time/queue_s"] = max(0.0, started_at - queued_at)
    if submitted_at is not None:
        out["time/first_step_s"] = started_at + parts["time/startup_s"] - submitted_at
    return out


def log_timing(client: MlflowClient, run_id: str, seconds: dict[str, float]) -> None:
    """Log a finished trial's wall-time breakdown (``breakdown``: seconds per
    ``time/<phase>_s``) on its run, at step 0."""
    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, float(v), now, 0) for k, v in seconds.items()])


def finished_trials(client: MlflowClient, experiment: str,
                    trial_ids: set[str] | None = None) -> list[dict[str, Any]]:
    """The trial runs of MLflow experiment ``experiment`` (of ``trial_ids`` only, when given)
    that logged a time breakdown (a finished trial's last act), each as ``{"variant", "size",
    "metrics"}`` (its tags, and the last value of every metric)."""
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    runs = client.search_runs([exp.experiment_id], f"tags.`{ROLE_TAG}` = 'trial' and "
                              "metrics.`time/total_s` >= 0", max_results=50_000)
    return [{"variant": r.data.tags.get("variant", "?"), "size": r.data.tags.get("size", "?"),
             "metrics": dict(r.data.metrics)} for r in runs
            if trial_ids is None or r.data.tags.get(TRIAL_TAG) in trial_ids]


def mirror_status(client: MlflowClient, run_id: str, status: Status) -> None:
    """Give MLflow run ``run_id`` the status its trial has in the ledger."""
    run_status = RunStatus.to_string(_RUN_STATUS[status])
    if status in (Status.FINISHED, Status.FAILED):
        client.set_terminated(run_id, run_status)
    else:
        client.update_run(run_id, status=run_status)


def ui_url(tracking_uri: str, exp_id: str) -> str | None:
    """Browser URL of the experiment when tracking goes through a server."""
    if tracking_uri.startswith(("http://", "https://")):
        return f"{tracking_uri.rstrip('/')}/#/experiments/{exp_id}"
    return None
