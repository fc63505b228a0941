"""Drive an experiment: prepare data, then train every trial with Ray Train + DeepSpeed."""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import ray
from mlflow import MlflowClient
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from orchestrator import settings, tracking
from orchestrator.plan import Trial, format_plan, plan_trials
from orchestrator.spec import ExperimentSpec
from orchestrator.table import format_table
from workloads.data import prepare_corpus
from workloads.train import TrainJob, train_loop_per_worker

log = logging.getLogger(__name__)

RESULT_METRICS = ("val_perplexity", "test_perplexity", "train_wall_s")


def _train_job(spec: ExperimentSpec, trial: Trial, corpus: dict, uri: str,
               run_id: str) -> TrainJob:
    t, r = spec.training, spec.resources
    return TrainJob(model=trial.model.to_dict(), corpus=corpus,
                    optim=dataclasses.asdict(t.optim_config()), tokens=trial.tokens,
                    batch_size=t.batch_size, micro_batch_size=t.micro_batch_size,
                    world_size=r.num_workers, zero_stage=t.zero_stage, precision=t.precision,
                    eval_interval=t.eval_interval, eval_sequences=t.eval_sequences,
                    log_interval=t.log_interval, seed=t.seed,
                    threads_per_worker=r.cpus_per_worker,
                    energy_diagnostics=t.energy_diagnostics, tracking_uri=uri, run_id=run_id)


def _fit(spec: ExperimentSpec, trial: Trial, job: TrainJob) -> None:
    r = spec.resources
    trainer = TorchTrainer(
        train_loop_per_worker, train_loop_config=job.to_dict(),
        scaling_config=ScalingConfig(num_workers=r.num_workers, use_gpu=r.use_gpu,
                                     resources_per_worker={"CPU": r.cpus_per_worker}),
        run_config=RunConfig(name=f"{spec.name}-{trial.trial_id}",
                             storage_path=str(settings.cemlab_home() / "ray_results")))
    trainer.fit()


def results_rows(client: MlflowClient, exp_id: str, trials: list[Trial]) -> list[dict]:
    """One row per trial with its latest MLflow run's status and headline metrics."""
    rows = []
    for trial in trials:
        runs = client.search_runs([exp_id], f"tags.`{tracking.TRIAL_TAG}` = '{trial.trial_id}'",
                                  order_by=["attributes.start_time DESC"], max_results=1)
        m = runs[0].data.metrics if runs else {}
        rows.append({"variant": trial.variant, "size": trial.size,
                     "params": trial.params["total"], "attn params": trial.params["attention"],
                     "mlp params": trial.params["mlp"], "tokens": trial.tokens,
                     "status": runs[0].info.status if runs else "-",
                     **{k: m.get(k) for k in RESULT_METRICS}})
    return rows


def run_experiment(spec: ExperimentSpec) -> bool:
    """Train every trial of ``spec`` not already FINISHED in MLflow; print the results.

    Each trial is one MLflow run in the experiment named ``spec.name`` and one Ray Train
    ``TorchTrainer`` run. A failed trial is marked FAILED and the others still run.

    Returns:
        True when every trial finished.
    """
    started = time.perf_counter()
    print(f"[cemlab] preparing corpus '{spec.data.source}' in {settings.data_dir()}", flush=True)
    corpus = prepare_corpus(spec.data.corpus_config(), settings.data_dir())
    print(f"[cemlab] corpus: {corpus.n_tokens} tokens, {corpus.n_documents} documents, "
          f"unigram test perplexity {corpus.unigram_test_perplexity:.1f}", flush=True)
    trials = plan_trials(spec, vocab_size=corpus.vocab_size)
    print(format_plan(spec, trials), flush=True)

    uri = settings.tracking_uri()
    client = MlflowClient(uri)
    exp_id = tracking.experiment_id(client, spec.name)
    # Inside `ray job submit` RAY_ADDRESS names the cluster; otherwise start a local instance
    # rather than attach to whatever cluster last ran on this machine (possibly a dead one).
    ray.init(address=os.environ.get("RAY_ADDRESS") or "local", log_to_driver=True)
    ok = True
    for i, trial in enumerate(trials, 1):
        label = f"[cemlab] trial {i}/{len(trials)} {trial.variant}@{trial.size} ({trial.trial_id})"
        if tracking.finished_run(client, exp_id, trial):
            print(f"{label}: already finished, skipped", flush=True)
            continue
        run_id = tracking.start_trial_run(
            client, exp_id, spec, trial,
            {"unigram_test_perplexity": corpus.unigram_test_perplexity})
        print(f"{label}: training, MLflow run {run_id}", flush=True)
        try:
            _fit(spec, trial, _train_job(spec, trial, corpus.to_dict(), uri, run_id))
        except Exception as e:  # one failed trial must not stop the grid
            log.error("%s failed: %s", label, e)
            tracking.end_run(client, run_id, ok=False)
            ok = False
        else:
            tracking.end_run(client, run_id, ok=True)

    print(f"\n[cemlab] results of '{spec.name}' "
          f"(unigram test perplexity {corpus.unigram_test_perplexity:.1f}, "
          f"wall {time.perf_counter() - started:.0f}s)")
    print(format_table(results_rows(client, exp_id, trials),
                       ["variant", "size", "params", "attn params", "mlp params", "tokens",
                        "status", *RESULT_METRICS]))
    url = tracking.ui_url(uri, exp_id)
    print(f"\nMLflow: {url or uri}\nDashboard: make dashboard", flush=True)
    return ok
