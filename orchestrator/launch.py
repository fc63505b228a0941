"""Ray Tune over a grid of trials, each trial one Ray Train run (``TorchTrainer``).

Tune runs ``trial_driver`` once per trial; the driver starts the trial's ``TorchTrainer`` and
keeps the ledger and the trial's MLflow run in step with it. The Train run is named after the
trial hash under ``<CEMLAB_HOME>/ray_results/trials``: launching the same trial again makes
Ray Train restore its checkpoint manager, so ``ray.train.get_checkpoint()`` in the workers
returns the last checkpoint and training resumes from there.
"""

from __future__ import annotations

import time
from typing import Any

import ray
import ray.tune
from mlflow import MlflowClient
from ray.train import CheckpointConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from ray.tune.integration.ray_train import TuneReportCallback

from orchestrator import tracking
from orchestrator.ledger import Ledger
from orchestrator.spec import ResourcesSpec

# Tune needs a non-empty resource request per trial; the driver itself only waits on its
# Train run (whose workers hold the CPUs/GPUs), so it asks for a token amount of memory.
_DRIVER_RESOURCES = {"CPU": 0, "memory": 2**20}


def _train_fn(workload: str):
    if workload == "gp_regression":
        from workloads.gp.train import train_gp_per_worker

        return train_gp_per_worker
    from workloads.train import train_loop_per_worker

    return train_loop_per_worker


def trial_driver(config: dict[str, Any], trials: dict[str, dict[str, Any]]) -> None:
    """Tune trainable: train trial ``config["trial_id"]`` with Ray Train, recording it in the
    ledger and MLflow.

    ``trials[trial_id]`` holds ``workload``, ``job`` (the worker config), ``metric``,
    ``ledger_url``, ``tracking_uri``, ``row_id``, ``run_id``, ``trial_id``, ``storage_path``
    and ``resources`` (``ResourcesSpec`` fields).

    Raises:
        ray.train.TrainingFailedError: the Train run failed (after marking the trial FAILED).
    """
    c = trials[config["trial_id"]]
    ledger, client = Ledger(c["ledger_url"]), MlflowClient(c["tracking_uri"])
    r = ResourcesSpec(**c["resources"])
    name = f"trial-{c['trial_id']}"
    ledger.update_trial(c["row_id"], status="RUNNING",
                        checkpoint_path=f"{c['storage_path']}/{name}")
    tracking.reopen_run(client, c["run_id"])
    trainer = TorchTrainer(
        _train_fn(c["workload"]), train_loop_config=c["job"],
        scaling_config=ScalingConfig(num_workers=r.num_workers, use_gpu=r.use_gpu,
                                     resources_per_worker={"CPU": r.cpus_per_worker}),
        run_config=RunConfig(name=name, storage_path=c["storage_path"],
                             checkpoint_config=CheckpointConfig(num_to_keep=1),
                             callbacks=[TuneReportCallback()]))
    try:
        result = trainer.fit()
    except Exception as e:
        ledger.update_trial(c["row_id"], status="FAILED", error=str(e)[-2000:])
        tracking.end_run(client, c["run_id"], ok=False)
        raise
    ledger.update_trial(c["row_id"], status="FINISHED", metric=result.metrics[c["metric"]],
                        checkpoint_path=result.checkpoint.path if result.checkpoint else None,
                        error=None)
    tracking.end_run(client, c["run_id"], ok=True)


def run_grid(name: str, trials: list[dict[str, Any]], resources: ResourcesSpec,
             storage_path: str) -> None:
    """Run ``trials`` (``trial_driver`` configs) with Ray Tune, as many at once as the connected
    cluster fits; each trial's outcome lands in the ledger and MLflow."""
    total = ray.cluster_resources()
    concurrency = resources.trials_that_fit(total.get("CPU", 0), total.get("GPU", 0))
    by_id = {c["trial_id"]: c for c in trials}
    print(f"[cemlab] Ray Tune: {len(trials)} trial(s), up to {concurrency} at once", flush=True)
    tuner = ray.tune.Tuner(
        ray.tune.with_resources(ray.tune.with_parameters(trial_driver, trials=by_id),
                                _DRIVER_RESOURCES),
        param_space={"trial_id": ray.tune.grid_search(list(by_id))},
        tune_config=ray.tune.TuneConfig(
            max_concurrent_trials=concurrency,
            trial_name_creator=lambda t: by_id[t.config["trial_id"]]["label"].replace(" ", "_"),
        ),
        run_config=ray.tune.RunConfig(name=f"{name}-{time.strftime('%Y%m%d-%H%M%S')}",
                                      storage_path=f"{storage_path}/tune", verbose=1))
    tuner.fit()
