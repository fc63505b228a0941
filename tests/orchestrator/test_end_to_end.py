"""End to end: local services, `python -m orchestrator run` on a tiny spec, metrics in MLflow.

Starts its own Ray head (token auth) and MLflow server with infra/local/up.sh in a temporary
CEMLAB_HOME, trains two tiny models with 2 Ray Train workers and DeepSpeed ZeRO-2 each, checks
what reached the MLflow server, re-submits through `ray job submit`, and stops the services.
"""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from orchestrator.plan import parameter_counts
from orchestrator.spec import parse_spec
from workloads.models import flops_per_token
from workloads.models.config import CEM_BEST
from workloads.optim import lr_factor

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

SPEC = {
    "name": "e2e",
    "data": {"source": "shakespeare", "vocab_size": 512},
    "sizes": ["nano"],
    "variants": {"llama": {"attention": "llama", "mlp": "llama"},
                 "cem": CEM_BEST},  # T = 2, shared diagonal, diag-plus-low-rank preconditioners
    "training": {"tokens": 40960, "batch_size": 16, "micro_batch_size": 8, "lr": 0.004,
                 "eval_interval": 20, "eval_sequences": 32, "log_interval": 5,
                 "zero_stage": 2, "energy_diagnostics": True},
    "resources": {"num_workers": 2, "cpus_per_worker": 1},
}


def read_env(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        if line.startswith("export "):
            key, _, value = line[len("export "):].partition("=")
            env[key] = value.strip('"')
    env["PATH"] = env["PATH"].replace("$PATH", os.environ["PATH"])
    return env


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    home = tmp_path_factory.mktemp("cemlab_home")
    env = {**os.environ, "CEMLAB_HOME": str(home), "VENV_BIN": str(Path(sys.executable).parent),
           "CEMLAB_RAY_PORT": "0", "CEMLAB_RAY_DASHBOARD_PORT": "0", "CEMLAB_MLFLOW_PORT": "0",
           "CEMLAB_RAY_CPUS": "2"}
    subprocess.run([str(ROOT / "infra/local/up.sh")], env=env, check=True, timeout=300)
    pids = [int((home / "run" / f"{name}.pid").read_text()) for name in ("ray", "mlflow")]
    try:
        yield home, {**os.environ, **read_env(home / "services.env")}
    finally:
        subprocess.run([str(ROOT / "infra/local/down.sh")], env=env, timeout=120)
        for pid in pids:  # down.sh stopped exactly what up.sh started
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)


def test_run_trains_and_tracks_every_trial(services, tmp_path):
    home, env = services
    spec_path = tmp_path / "e2e.yaml"
    spec_path.write_text(yaml.safe_dump(SPEC))
    assert (home / "ray_auth_token").stat().st_mode & 0o077 == 0  # the token is private

    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator", "run", str(spec_path)], cwd=ROOT,
        env={**env, "RAY_ADDRESS": env["CEMLAB_RAY_GCS_ADDRESS"]}, capture_output=True,
        text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "results of 'e2e'" in proc.stdout

    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name("e2e")
    runs = client.search_runs([exp.experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["cem@nano", "llama@nano"]
    spec = parse_spec(SPEC)
    steps = 40960 // (16 * 64)
    for run in runs:
        m, p = run.data.metrics, run.data.params
        assert run.info.status == "FINISHED"
        variant = run.data.tags["variant"]
        counts = parameter_counts(spec.resolve_model("nano", variant))
        assert {k: int(m[f"params_{k}"]) for k in counts} == counts
        assert p["model.attention"] == variant and p["training.zero_stage"] == "2"
        assert m["tokens_seen"] == steps * 16 * 64
        assert m["test_perplexity"] == pytest.approx(math.exp(m["test_loss"]), rel=1e-6)
        assert m["val_perplexity"] == pytest.approx(math.exp(m["val_loss"]), rel=1e-6)
        assert 1 < m["test_perplexity"] < m["unigram_test_perplexity"] * 1.5
        assert m["tokens_per_s"] > 0
        cfg = spec.resolve_model("nano", variant)
        assert m["flops_per_token"] == pytest.approx(flops_per_token(cfg, 64))
        assert m["flops_per_s"] == pytest.approx(m["tokens_per_s"] * m["flops_per_token"])
        if variant == "cem":  # energy diagnostics reached MLflow, for every layer and step
            for layer, name, t in [(0, "attn", 0), (1, "attn", 2), (1, "mlp", 2)]:
                assert math.isfinite(m[f"energy/{name}/layer{layer}/step{t}"])
            assert m["precond_min_eig/mlp/layer1"] > 0
            assert "precond_min_eig/attn/layer0/head1" in m
        else:
            assert not any(k.startswith("energy/") for k in m)

        loss = [x.value for x in client.get_metric_history(run.info.run_id, "loss")]
        assert len(loss) == steps
        assert sum(loss[-5:]) / 5 < sum(loss[:5]) / 5 - 0.5  # the loss goes down
        lr = {x.step: x.value for x in client.get_metric_history(run.info.run_id, "lr")}
        for step in (1, steps // 2, steps):  # the schedule that ran is the paper's schedule
            expected = 0.004 * lr_factor(step - 1, steps, 0.05, 0.1)  # step s uses f(s - 1)
            assert lr[step] == pytest.approx(expected, rel=1e-6)
        val = client.get_metric_history(run.info.run_id, "val_perplexity")
        assert sorted(x.step for x in val) == [20, steps]

    # The same spec through the job server: every trial is already finished and skipped.
    job = subprocess.run(
        ["ray", "job", "submit", "--working-dir", ".", "--", "python", "-m", "orchestrator",
         "run", str(spec_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    assert job.stdout.count("already finished, skipped") == 2
    assert len(client.search_runs([exp.experiment_id])) == 2
