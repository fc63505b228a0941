"""The stack on PostgreSQL with a password (MLflow's backend store and the ledger), a trial run
through it: the password reaches neither MLflow (params, tags, the spec artifact) nor the
driver's output nor any log of the stack."""

import json
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests.conftest import RAY_CLUSTER
from tests.orchestrator.conftest import local_services, orchestrator, stack_logs, write_spec

pytestmark = [pytest.mark.slow, RAY_CLUSTER]


def test_a_database_password_never_reaches_mlflow_or_a_log(tmp_path, postgres_with_password):
    host, port, user, password = postgres_with_password
    url = f"postgresql+psycopg2://{user}:{password}@{host}:{port}/postgres"
    with local_services(tmp_path / "home", CEMLAB_MLFLOW_BACKEND_URI=url) as (home, env):
        assert env["CEMLAB_LEDGER_URL"] == url  # the ledger shares MLflow's database
        spec = {"name": "secret", "workload": "gp_regression",
                "gp": {"kernels": ["rbf"], "n_train": 256, "n_val": 64, "n_test": 64,
                       "steps": 40},
                "sizes": ["gp-small"], "variants": {"t1": {"mlp_steps": 1}},
                "learning_rates": [0.004], "training": {"batch_size": 32, "eval_interval": 20},
                "resources": {"num_workers": 1}}
        proc = orchestrator(env, "run", str(write_spec(tmp_path, spec)))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        client = MlflowClient(env["MLFLOW_TRACKING_URI"])
        runs = client.search_runs([client.get_experiment_by_name("secret").experiment_id])
        assert len(runs) == 2  # the parent run and the trial's, on PostgreSQL
        spec_artifact = Path(client.download_artifacts(
            next(r for r in runs if r.data.tags["cemlab.role"] == "experiment").info.run_id,
            "spec.yaml", str(tmp_path))).read_text()
        logs = stack_logs(home, env)
        for run in runs:
            assert password not in json.dumps([run.data.params, run.data.tags])
        assert password not in spec_artifact + proc.stdout + proc.stderr + logs
        # Nor what Ray Tune and Train keep in the storage root (experiment state, checkpoints).
        stored = [p for p in (home / "ray_results").rglob("*") if p.is_file()]
        assert stored and not [p for p in stored if password.encode() in p.read_bytes()]
