"""The cluster's services on one machine: a grid whose storage root is an S3 bucket (a real S3
API server, moto, on 127.0.0.1) and whose MLflow server keeps runs in PostgreSQL (a server of
its own with scram-sha-256 passwords) and proxies artifacts to the bucket. The corpus, the Ray
Train checkpoints, the Tune state and the model go to the bucket, nothing to the home; the
database password reaches neither MLflow (params, tags, the spec artifact) nor the job's output
nor any log of the stack nor any file in the bucket; a bucket that does not exist is one line
before anything starts."""

import json
import subprocess
from pathlib import Path

import pyarrow.fs as pafs
import pytest
from mlflow import MlflowClient

from orchestrator.records.ledger import Ledger, Status
from tests.orchestrator.conftest import ROOT, local_services, orchestrator, stack_logs, write_spec
from workloads.core.logged_model import model_of_run
from workloads.core.storage import StorageRoot

pytestmark = pytest.mark.slow  # in the background process (tests/conftest.py)


def _keys(storage: StorageRoot) -> set[str]:
    """Every file under the storage root, relative to it."""
    fs, root = storage.filesystem()
    return {i.path.removeprefix(root + "/") for i in
            fs.get_file_info(pafs.FileSelector(root, recursive=True)) if i.is_file}

SPEC = {"name": "s3-grid", "data": {"source": "shakespeare", "vocab_size": 512},
        "sizes": ["nano"], "variants": {"llama": {}}, "learning_rates": [0.004],
        "budget": {"tokens": 40 * 16 * 64},
        "training": {"batch_size": 16, "eval_interval": 20, "eval_sequences": 16},
        "resources": {"num_workers": 2, "cpus_per_worker": 1}}


def test_a_grid_keeps_its_state_in_the_bucket_and_its_database_password_nowhere(
        s3_server, s3_bucket, postgres_with_password, tmp_path_factory, tmp_path):
    host, port, user, password = postgres_with_password
    database = f"postgresql+psycopg2://{user}:{password}@{host}:{port}/postgres"
    storage = StorageRoot(uri=f"s3://{s3_bucket}/lab", endpoint_url=s3_server)
    home = tmp_path_factory.mktemp("cemlab_home")
    with local_services(home, CEMLAB_STORAGE=storage.uri, CEMLAB_S3_ENDPOINT_URL=s3_server,
                        CEMLAB_MLFLOW_BACKEND_URI=database) as (home, env):
        assert env["CEMLAB_LEDGER_URL"] == database  # the ledger shares MLflow's database
        job = subprocess.run(  # the job's driver gets the storage root from the Ray head
            ["ray", "job", "submit", "--working-dir", ".", "--", "python", "-m", "orchestrator",
             "run", str(write_spec(tmp_path, SPEC))], cwd=ROOT, env=env, capture_output=True,
            text=True, timeout=900)
        assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]

        ledger = Ledger(env["CEMLAB_LEDGER_URL"])
        (row,) = ledger.trials(ledger.experiment("s3-grid").id)
        assert row.status == Status.FINISHED
        trial_dir = f"ray_results/trials/s3-grid/trial-{row.trial_hash}"
        assert row.checkpoint_path.startswith(storage.uri_of(trial_dir, "checkpoint_"))
        files = _keys(storage)
        corpus = {f for f in files if f.startswith("data/corpus-")}
        assert {f.rsplit("/", 1)[1] for f in corpus} == {
            "train-00000.bin", "validation-00000.bin", "test-00000.bin", "tokenizer.json",
            "manifest.json"}
        # The final checkpoint: both ranks' DeepSpeed shards, under the trial's run.
        final = row.checkpoint_path.removeprefix(storage.uri + "/")
        assert any(f.startswith(final + "/") and f.endswith("model_states.pt") for f in files)
        assert any(f.startswith("ray_results/tune/s3-grid-") for f in files)
        assert not (home / "ray_results").exists()  # nothing went to the node's home
        # The model, the run's logged model, went through the tracking server (no S3 client on
        # the worker) to the bucket.
        client = MlflowClient(env["MLFLOW_TRACKING_URI"])
        model = model_of_run(client, row.mlflow_run_id)
        assert model.artifact_location.startswith("mlflow-artifacts:/")
        assert any(f.startswith("mlartifacts/")
                   and f.endswith(f"models/{model.model_id}/artifacts/MLmodel")
                   for f in _keys(storage))
        assert not (home / "mlartifacts").exists()

        # The password: in no MLflow param or tag, not in the spec artifact, the job's output,
        # any log of the stack or Ray's session logs, nor in any file of the bucket (Ray Tune's
        # pickled search state and Train's checkpoints included).
        runs = client.search_runs([client.get_experiment_by_name("s3-grid").experiment_id])
        assert len(runs) == 2  # the parent run and the trial's, on PostgreSQL
        spec_artifact = Path(client.download_artifacts(
            next(r for r in runs if r.data.tags["cemlab.role"] == "experiment").info.run_id,
            "spec.yaml", str(tmp_path))).read_text()
        for run in runs:
            assert password not in json.dumps([run.data.params, run.data.tags])
        assert password not in spec_artifact + job.stdout + job.stderr + stack_logs(home, env)
        fs, root = storage.filesystem()
        stored = sorted(_keys(storage))
        assert stored and not [f for f in stored if password.encode() in
                               fs.open_input_stream(f"{root}/{f}").read()]

        missing = orchestrator({**env, "CEMLAB_STORAGE": "s3://no-such-bucket/lab"}, "run",
                               str(write_spec(tmp_path, {**SPEC, "name": "s3-missing"})))
        assert missing.returncode == 2 and missing.stdout == ""
        assert missing.stderr.strip().splitlines() == [
            "error: storage root s3://no-such-bucket/lab: bucket 'no-such-bucket' does not "
            "exist"]
