"""A third workload is one class plus one ``register`` line: a toy workload defined here goes
through spec validation, planning, the plan table, wall-time calibration, MLflow bookkeeping and
its own train loop, with no change to the orchestrator."""

import math

import pytest
import torch
import torch.nn.functional as F
from mlflow import MlflowClient
from pydantic import Field

from orchestrator import tracking
from orchestrator.calibrate import estimate_wall_s
from orchestrator.plan import format_plan, plan
from orchestrator.spec import SpecError, parse_spec
from workloads.base import Budget, Job, Prepared, Workload
from workloads.config import StrictModel
from workloads.registry import WORKLOADS, register
from workloads.train import run_in_process


class ToyConfig(StrictModel):
    """Fit y = w·x in ``dim`` dimensions for ``steps`` steps."""

    dim: int = Field(4, gt=0)
    steps: int = Field(60, gt=0)


class ToyRegression(Workload[ToyConfig, None]):
    name, section, config_type, metric, unit = "toy", "toy", ToyConfig, "test_mse", "examples"
    selection_metric = "val_mse"
    micro_batches = False

    def prepare(self, config, data_dir):
        return Prepared(None, {"toy_floor": 0.0}, "nothing to prepare")

    def budget(self, config, training, size, model):
        examples = config.steps * training.batch_size
        return Budget(config.steps, examples, 6.0 * config.dim * examples,
                      {"total": config.dim, "embedding": 0, "attention": 0, "mlp": 0,
                       "other": config.dim, "non_embedding": config.dim})

    def calibration_step(self, config, model, micro_batch_size, device):
        w = torch.zeros(config.dim, requires_grad=True)
        x = torch.randn(micro_batch_size, config.dim)
        return (lambda: (x @ w).square().mean().backward()), 6.0 * config.dim * micro_batch_size

    def train(self, job, session):
        trial, cfg = job.trial, job.trial.config
        torch.manual_seed(trial.seed)
        target = torch.randn(cfg.dim)
        engine = session.engine(torch.nn.Linear(cfg.dim, 1, bias=False), backend="ddp")
        for step in range(1, trial.steps + 1):
            x = torch.randn(trial.micro_batch_size, cfg.dim)
            loss = F.mse_loss(engine(x).squeeze(-1), x @ target)
            engine.backward(loss)
            lr = engine.lr()
            engine.step()
            session.log({"loss": loss.item(), "lr": lr}, step)
        val, test = torch.randn(256, cfg.dim), torch.randn(256, cfg.dim)
        with torch.no_grad():
            return {f"{split}_mse": F.mse_loss(engine(x).squeeze(-1), x @ target).item()
                    for split, x in (("val", val), ("test", test))}


@pytest.fixture
def toy():
    register(ToyRegression)  # the one registration line a new workload needs
    yield WORKLOADS["toy"]
    del WORKLOADS["toy"]


SPEC = {"name": "toy-grid", "workload": "toy", "toy": {"dim": 3, "steps": 80},
        "sizes": ["nano"], "variants": {"a": {}}, "learning_rates": [0.01, 0.05],
        "seeds": [0, 1], "training": {"batch_size": 32, "warmup_fraction": 0.0},
        "resources": {"num_workers": 2}}


def test_a_toy_workload_is_validated_planned_tracked_and_trained(toy, tmp_path):
    spec = parse_spec(SPEC)
    assert spec.workload_config == ToyConfig(dim=3, steps=80)
    assert parse_spec(spec.model_dump()) == spec  # dumps under its own section key, "toy"
    trials = plan(spec)
    assert len(trials) == 4 and len({t.trial_id for t in trials}) == 4
    assert {(t.steps, t.tokens, t.micro_batch_size, t.grad_accum) for t in trials} == {
        (80, 80 * 32, 16, 1)}  # its budget, and no micro-batching: 32 over 2 workers
    table = format_plan(spec, trials, estimate_wall_s(trials), 1)
    assert "examples" in table and all(t.trial_id in table for t in trials)

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = tracking.experiment_id(client, spec.name)
    parent = tracking.start_parent_run(client, exp, spec, "")
    run = client.get_run(tracking.start_trial_run(client, exp, parent, trials[0],
                                                   {"toy_floor": 0.0}))
    assert run.data.params["toy.dim"] == "3" and run.data.params["dataset"] == "toy"

    final, session = run_in_process(Job(trials[-1]))
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
