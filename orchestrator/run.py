"""Drive an experiment: prepare data, claim trials in the ledger, run the rest with Ray Tune,
then analyse (Akima optima) and register the best models."""

from __future__ import annotations

import dataclasses
import os
import time

import ray
from mlflow import MlflowClient

from orchestrator import launch, settings, tracking
from orchestrator.ledger import Ledger
from orchestrator.plan import Trial, format_plan, plan_trials
from orchestrator.registry import register_best
from orchestrator.results import (
    experiment_rows,
    format_optima,
    metric_name,
    optima,
    store_on_parent,
)
from orchestrator.spec import ExperimentSpec
from orchestrator.table import format_table
from workloads.data import prepare_corpus
from workloads.gp.train import GPJob
from workloads.train import TrainJob


def _job(spec: ExperimentSpec, trial: Trial, corpus: dict | None, uri: str,
         run_id: str) -> dict:
    """The worker config of one trial (``TrainJob`` or ``GPJob`` as a dict)."""
    t, r = spec.training, spec.resources
    optim = dataclasses.asdict(t.optim_config(trial.lr))
    if spec.workload == "gp_regression":
        g = spec.gp
        return GPJob(model=trial.model.to_dict(), kernel=trial.dataset.removeprefix("gp-"),
                     input_dim=g.input_dim, n_train=g.n_train, n_val=g.n_val, n_test=g.n_test,
                     noise_std=g.noise_std, data_seed=g.data_seed, optim=optim,
                     steps=trial.steps, batch_size=t.batch_size, eval_interval=t.eval_interval,
                     log_interval=t.log_interval, seed=trial.seed,
                     threads_per_worker=r.cpus_per_worker, tracking_uri=uri,
                     run_id=run_id).to_dict()
    return TrainJob(model=trial.model.to_dict(), corpus=corpus, optim=optim, tokens=trial.tokens,
                    batch_size=t.batch_size, micro_batch_size=trial.micro_batch_size,
                    world_size=r.num_workers, zero_stage=t.zero_stage, precision=t.precision,
                    eval_interval=t.eval_interval, eval_sequences=t.eval_sequences,
                    log_interval=t.log_interval, seed=trial.seed,
                    threads_per_worker=r.cpus_per_worker,
                    energy_diagnostics=t.energy_diagnostics, tracking_uri=uri,
                    run_id=run_id).to_dict()


def run_experiment(spec: ExperimentSpec, spec_yaml: str) -> bool:
    """Run every trial of ``spec`` not yet FINISHED in the ledger; analyse; register.

    Exactly once: a trial's ledger row keeps its single MLflow run (nested under the
    experiment's parent run); a finished trial is skipped, an unfinished one resumes from its
    last Ray Train checkpoint. Failed trials do not stop the others.

    Returns:
        True when every trial of the grid has finished.
    """
    started = time.perf_counter()
    corpus, extra = None, {}
    if spec.workload == "language_model":
        print(f"[cemlab] preparing corpus '{spec.data.source}' in {settings.data_dir()}",
              flush=True)
        prepared = prepare_corpus(spec.data.corpus_config(), settings.data_dir())
        print(f"[cemlab] corpus: {prepared.n_tokens} tokens, {prepared.n_documents} documents, "
              f"unigram test perplexity {prepared.unigram_test_perplexity:.1f}", flush=True)
        corpus, extra = prepared.to_dict(), {
            "unigram_test_perplexity": prepared.unigram_test_perplexity}
    trials = plan_trials(spec, vocab_size=corpus["vocab_size"] if corpus else None)
    print(format_plan(spec, trials), flush=True)

    uri = settings.tracking_uri()
    client = MlflowClient(uri)
    ledger_url = settings.ledger_url()
    ledger = Ledger(ledger_url)
    results_dir = settings.cemlab_home() / "ray_results"  # Tune state and trial checkpoints
    exp = ledger.ensure_experiment(spec.name, spec.workload, spec_yaml)
    exp_id = tracking.experiment_id(client, spec.name)
    parent = exp.parent_run_id or tracking.start_parent_run(client, exp_id, spec, spec_yaml)
    ledger.update_experiment(exp.id, mlflow_experiment_id=exp_id, parent_run_id=parent)
    tracking.reopen_run(client, parent)

    pending = []
    for trial in trials:
        row = ledger.ensure_trial(exp.id, trial.trial_id, dataset=trial.dataset,
                                  variant=trial.variant, size=trial.size, lr=trial.lr,
                                  seed=trial.seed)
        if row.status == "FINISHED":
            print(f"[cemlab] {trial.label} ({trial.trial_id}): finished, skipped", flush=True)
            continue
        run_id = row.mlflow_run_id
        if run_id is None:  # never two runs per trial, even after a crash right here
            run_id = (tracking.find_trial_run(client, exp_id, trial.trial_id)
                      or tracking.start_trial_run(client, exp_id, parent, spec, trial, extra))
            ledger.update_trial(row.id, mlflow_run_id=run_id)
        pending.append({"workload": spec.workload, "trial_id": trial.trial_id,
                        "label": trial.label, "row_id": row.id, "run_id": run_id,
                        "metric": metric_name(spec), "ledger_url": ledger_url,
                        "tracking_uri": uri, "resources": spec.resources.model_dump(),
                        "storage_path": str(results_dir / "trials"),
                        "job": _job(spec, trial, corpus, uri, run_id)})
    if pending:
        # Inside `ray job submit` RAY_ADDRESS names the cluster; otherwise start a local
        # instance rather than attach to whatever cluster last ran here (possibly a dead one).
        ray.init(address=os.environ.get("RAY_ADDRESS") or "local", log_to_driver=True)
        launch.run_grid(spec.name, pending, spec.resources, str(results_dir))

    rows = experiment_rows(spec, ledger, {t.trial_id for t in trials})
    done = all(r.status == "FINISHED" for r in rows) and len(rows) == len(trials)
    short = metric_name(spec).removeprefix("test_")
    table = optima(spec, rows)
    store_on_parent(client, parent, table, short)
    print(f"\n[cemlab] results of '{spec.name}' (wall {time.perf_counter() - started:.0f}s)")
    by_hash = {r.trial_hash: r for r in rows}
    print(format_table(
        [{"dataset": t.dataset, "variant": t.variant, "size": t.size, "lr": f"{t.lr:g}",
          "seed": t.seed, "params": t.params["total"], "tokens": t.tokens,
          "status": by_hash[t.trial_id].status, metric_name(spec): by_hash[t.trial_id].metric}
         for t in trials if t.trial_id in by_hash],
        ["dataset", "variant", "size", "lr", "seed", "params", "tokens", "status",
         metric_name(spec)]))
    if table:
        print(f"\n[cemlab] Akima optima over log2(LR) of {metric_name(spec)}")
        print(format_optima(table, short))
    if done and spec.workload == "language_model":
        results = {r.trial_hash: (r.mlflow_run_id, r.metric) for r in rows}
        for line in register_best(client, spec.name, trials, results, spec.data.model_dump()):
            print(f"[cemlab] registered {line}")
    tracking.end_run(client, parent, ok=done)
    url = tracking.ui_url(uri, exp_id)
    print(f"\nMLflow: {url or uri}\nDashboard: make dashboard", flush=True)
    return done
