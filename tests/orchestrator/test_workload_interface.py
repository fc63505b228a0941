"""A third workload is one class plus one ``register`` call: a toy workload defined here goes
through spec validation, planning, the plan table, wall-time calibration, MLflow bookkeeping and
the one ``Trainer`` (it supplies a model, batches, a loss and an evaluation), with no change to
the orchestrator."""

import math

import pytest
import torch
import torch.nn.functional as F
from mlflow import MlflowClient
from pydantic import Field

from orchestrator.planning.calibrate import estimate_wall_s
from orchestrator.planning.plan import format_plan, plan
from orchestrator.planning.spec import SpecError, parse_spec
from orchestrator.records import tracking
from workloads.core import registry
from workloads.core.config import StrictModel
from workloads.core.trial import Budget, Job, Prepared
from workloads.runtime.trainer import Task
from workloads.runtime.worker import TrainedWorkload, run_in_process


class ToyConfig(StrictModel):
    """Fit y = w·x in ``dim`` dimensions for ``steps`` steps."""

    dim: int = Field(4, gt=0)
    steps: int = Field(60, gt=0)


class ToyRegression(TrainedWorkload):
    name, section, config_type, metric, unit = "toy", "toy", ToyConfig, "test_mse", "examples"
    selection_metric = "val_mse"
    micro_batches = False

    def prepare(self, config, data_dir):
        return Prepared(None, {"toy_floor": 0.0}, "nothing to prepare")

    def budget(self, config, budget, training, size, model):
        examples = config.steps * training.batch_size
        return Budget(config.steps, examples, 6.0 * config.dim * examples,
                      {"total": config.dim, "embedding": 0, "attention": 0, "mlp": 0,
                       "other": config.dim, "non_embedding": config.dim})

    def calibration_step(self, config, model, micro_batch_size, device, stack=1):
        w = torch.zeros(config.dim, requires_grad=True)
        x = torch.randn(micro_batch_size, config.dim)
        return (lambda: (x @ w).square().mean().backward()), 6.0 * config.dim * micro_batch_size

    def task(self, job, session):
        return ToyTask(job.trial)


class ToyTask(Task):
    """y = w·x for a random w of the trial's seed, on fresh draws every step."""

    backend, unit, headline = "ddp", "examples", ("val_mse", "test_mse")

    def __init__(self, trial):
        self.trial, dim = trial, trial.config.dim
        self.target = torch.randn(dim, generator=torch.Generator().manual_seed(trial.seed))
        self.units_per_step, self.flops_per_unit = trial.training.batch_size, 6.0 * dim
        self.describe = f"a {dim}-dimensional linear map"

    def build_model(self):
        return torch.nn.Linear(self.trial.config.dim, 1, bias=False)

    def batches(self, skip):
        while True:
            x = torch.randn(self.trial.micro_batch_size, self.trial.config.dim)
            yield x, x @ self.target

    def loss(self, engine, batch):
        x, y = batch
        return F.mse_loss(engine(x).squeeze(-1), y)

    def evaluate(self, engine, split):
        x = torch.randn(256, self.trial.config.dim)
        with torch.no_grad():
            mse = F.mse_loss(engine(x).squeeze(-1), x @ self.target).item()
        return {{"validation": "val_mse", "test": "test_mse"}[split]: mse}


@pytest.fixture
def toy():
    registry.register(ToyRegression)  # the one registration line a new workload needs
    yield registry.get_workload("toy")
    registry._REGISTERED.pop("toy")


SPEC = {"name": "toy-grid", "workload": "toy", "toy": {"dim": 3, "steps": 80},
        "sizes": ["nano"], "variants": {"a": {}}, "learning_rates": [0.01, 0.05],
        "seeds": [0, 1], "training": {"batch_size": 32}, "schedule": {"warmup_fraction": 0.0},
        "resources": {"num_workers": 2}}


def test_a_toy_workload_is_validated_planned_tracked_and_trained(toy, tmp_path):
    spec = parse_spec(SPEC)
    assert spec.workload_config == ToyConfig(dim=3, steps=80)
    assert parse_spec(spec.model_dump()) == spec  # dumps under its own section key, "toy"
    trials = plan(spec)
    assert len(trials) == 4 and len({t.trial_id for t in trials}) == 4
    assert {(t.steps, t.tokens, t.micro_batch_size, t.grad_accum) for t in trials} == {
        (80, 80 * 32, 16, 1)}  # its budget, and no micro-batching: 32 over 2 workers
    table = format_plan(spec, trials, estimate_wall_s(trials, toy), 1)
    assert "examples" in table and all(t.trial_id in table for t in trials)

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = tracking.experiment_id(client, spec.name)
    parent = tracking.start_parent_run(client, exp, spec, "")
    run = client.get_run(tracking.start_trial_run(client, exp, parent, trials[0], "toy",
                                                   {"toy_floor": 0.0}))
    assert run.data.params["toy.dim"] == "3" and run.data.params["dataset"] == "toy"

    final, session = run_in_process(Job(trials[-1]), toy)
    assert final["test_mse"] < 0.1 * session.history["loss"][1]  # it learned the map
    assert math.isclose(session.history["lr"][1], 0.05)


def test_a_toy_spec_rejects_another_workloads_section_and_its_own_typos(toy):
    with pytest.raises(SpecError, match=r"data: unknown key \(workload toy takes 'toy'\)"):
        parse_spec({**SPEC, "data": {"source": "shakespeare"}})
    with pytest.raises(SpecError, match=r"toy\.dims: unknown key"):
        parse_spec({**SPEC, "toy": {"dims": 3}})
    with pytest.raises(SpecError, match=r"workload: unknown workload 'toys'; known: "
                                        r"gp_regression, language_model, toy"):
        parse_spec({**SPEC, "workload": "toys"})
