"""MLflow bookkeeping of the driver: one experiment per spec, one run per trial."""

from __future__ import annotations

import time
from typing import Any

from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunStatus

from orchestrator.plan import Trial
from orchestrator.spec import ExperimentSpec

TRIAL_TAG = "cemlab.trial_id"


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
    return exp.experiment_id if exp else client.create_experiment(name)


def finished_run(client: MlflowClient, exp_id: str, trial: Trial):
    """The FINISHED run of ``trial`` in ``exp_id``, or None."""
    runs = client.search_runs([exp_id], filter_string=f"tags.`{TRIAL_TAG}` = '{trial.trial_id}' "
                              "and attributes.status = 'FINISHED'", max_results=1)
    return runs[0] if runs else None


def start_trial_run(client: MlflowClient, exp_id: str, spec: ExperimentSpec, trial: Trial,
                    extra_metrics: dict[str, float]) -> str:
    """Create the trial's run with its resolved config as params and its parameter counts.

    Params: ``model.*`` (the resolved ``ModelConfig``), ``data.*``, ``training.*``,
    ``resources.*``. Metrics at step 0: ``params_<role>`` for every ``count_parameters`` role,
    ``flops_per_token`` (training, analytic), plus ``extra_metrics``. Returns the run id.
    """
    tags = {TRIAL_TAG: trial.trial_id, "variant": trial.variant, "size": trial.size,
            "attention": trial.model.attention, "mlp": trial.model.mlp}
    run = client.create_run(exp_id, run_name=f"{trial.variant}@{trial.size}", tags=tags)
    params = flatten({"model": trial.model.to_dict(), "data": spec.data.model_dump(),
                      "training": spec.training.model_dump(),
                      "resources": spec.resources.model_dump()})
    params.update({"trial_id": trial.trial_id, "training.steps": trial.steps})
    items = [Param(k, str(v)) for k, v in params.items()]
    now = int(time.time() * 1000)
    metrics = [Metric(f"params_{k}", float(v), now, 0) for k, v in trial.params.items()]
    metrics.append(Metric("flops_per_token", trial.flops / trial.tokens, now, 0))
    metrics += [Metric(k, float(v), now, 0) for k, v in extra_metrics.items()]
    for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
        client.log_batch(run.info.run_id, params=items[i:i + 100])
    client.log_batch(run.info.run_id, metrics=metrics)
    return run.info.run_id


def end_run(client: MlflowClient, run_id: str, ok: bool) -> None:
    client.set_terminated(run_id, RunStatus.to_string(RunStatus.FINISHED if ok
                                                      else RunStatus.FAILED))


def ui_url(tracking_uri: str, exp_id: str) -> str | None:
    """Browser URL of the experiment when tracking goes through a server."""
    if tracking_uri.startswith(("http://", "https://")):
        return f"{tracking_uri.rstrip('/')}/#/experiments/{exp_id}"
    return None
