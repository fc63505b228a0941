"""The GP-regression workload: its budget and its train loop in-process."""

import pytest

from workloads.core.config import (
    BudgetConfig,
    EngineConfig,
    OptimizerConfig,
    ResourcesConfig,
    ScheduleConfig,
    TrainingConfig,
)
from workloads.core.registry import get_workload
from workloads.core.trial import Job, Trial
from workloads.gp.workload import GPConfig, GPRegression, gp_parameter_counts
from workloads.models import ModelConfig
from workloads.runtime.worker import run_in_process


def test_gp_trial_fits_below_the_prior_and_logs_every_step():
    workload = get_workload("gp_regression")
    config = GPConfig(kernels=["rbf"], n_train=512, n_val=64, n_test=128, steps=150)
    training = TrainingConfig(batch_size=64, eval_interval=50, log_interval=50)
    model = ModelConfig.from_preset("gp-small", mlp_steps=2)
    budget = workload.budget(config, BudgetConfig(), training, "gp-small", model)
    assert (budget.steps, budget.units) == (150, 150 * 64)
    assert budget.params == gp_parameter_counts(model, 10) and budget.params["attention"] == 0
    trial = Trial("t", workload.name, "gp-rbf", "t2", "gp-small", 0.004, 0, model, config,
                  training=training, optimizer=OptimizerConfig(), schedule=ScheduleConfig(),
                  engine=EngineConfig(), resources=ResourcesConfig(num_workers=1),
                  budget=budget, micro_batch_size=64, grad_accum=1)
    final, session = run_in_process(Job(trial), GPRegression())
    assert sorted(session.history["loss"]) == list(range(1, 151))
    assert sorted(session.history["val_rmse"]) == [50, 100, 150]
    assert final["test_rmse"] < 0.6  # the prior's standard deviation is 1
    assert session.history["val_rmse"][150] < session.history["val_rmse"][50]
    assert final["test_rmse"] == pytest.approx(session.history["test_rmse"][150])
