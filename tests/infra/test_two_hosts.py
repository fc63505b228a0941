"""The cluster path, rehearsed on two hosts that share nothing but a network
(``infra/rehearsal/two_hosts.py``; ``make cluster-test`` runs this test with its report shown).

One trial of 2 Ray Train workers, DeepSpeed ZeRO-2 over gloo, is submitted with ``ray job
submit``; its corpus comes from S3, its checkpoints go to S3, its metrics to MLflow over the
veth. Asserted:
- a storage root on host A's disk is refused in one line before anything starts;
- SIGKILL of every process of host B mid-trial, then a restart of its node: the trial resumes
  from its S3 checkpoint in the same job and finishes in the same MLflow run;
- with STRICT_SPREAD, its ranks ran on both hosts (the Ray node ids on its MLflow run);
- its test perplexity, interrupted as it was, equals that of the same trial with both workers
  on host A (STRICT_PACK, same seed, uninterrupted) to 1e-6 relative: it resumed where it was,
  and two hosts compute what one does;
- host B never saw host A's ``CEMLAB_HOME``: it fetched the corpus from S3 into its own.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from infra.rehearsal.two_hosts import B_HOME, TwoHosts, missing_requirement
from orchestrator.records.ledger import Ledger, Status
from orchestrator.records.tracking import ROLE_TAG
from tests.conftest import RAY_CLUSTER
from tests.orchestrator.conftest import write_spec
from workloads.core.storage import StorageRoot

pytestmark = [pytest.mark.slow, RAY_CLUSTER,
              pytest.mark.skipif(missing_requirement() is not None,
                                 reason=missing_requirement() or "")]

STEPS = 100
SPEC = {"name": "two-hosts", "data": {"source": "shakespeare", "vocab_size": 512},
        "sizes": ["nano"], "variants": {"llama": {}}, "learning_rates": [0.004],
        "budget": {"tokens": STEPS * 16 * 64},
        "training": {"batch_size": 16, "eval_interval": 20, "eval_sequences": 16},
        "engine": {"precision": "fp32", "zero_stage": 2},
        "resources": {"num_workers": 2, "cpus_per_worker": 1,
                      "placement_strategy": "STRICT_SPREAD"}}


def _spec(name: str, placement: str) -> dict:
    spec = copy.deepcopy(SPEC)
    spec["name"] = name
    spec["resources"]["placement_strategy"] = placement
    return spec


def _finish(job, log: Path, timeout_s: float = 900) -> str:
    """Wait for ``ray job submit``; its whole output is kept in ``log``."""
    out, _ = job.communicate(timeout=timeout_s)
    log.write_text(out)
    assert job.returncode == 0, f"{out[-4000:]}\n(whole log: {log})"
    return out


def _row(hosts: TwoHosts, name: str):
    ledger = Ledger(hosts.env["CEMLAB_LEDGER_URL"])
    (row,) = ledger.trials(ledger.experiment(name).id)
    return row


def test_a_trial_spans_two_hosts_survives_losing_one_and_matches_one_host(
        postgres_db, tmp_path):
    with TwoHosts(tmp_path / "rehearsal", postgres_db) as hosts:
        nodes = hosts.alive_nodes()
        print(f"\n[two-hosts] Ray nodes: {', '.join(n['ip'] for n in nodes)}")
        assert sorted(n["ip"] for n in nodes) == [hosts.a, hosts.b]

        # A storage root on host A's disk would not reach host B: one line, nothing starts.
        local_root = str(hosts.home / "local-root")
        for _ in range(10):  # the head's job agent may register after its dashboard answers
            job = hosts.submit(write_spec(tmp_path, _spec("host-only", "STRICT_SPREAD")),
                               CEMLAB_STORAGE=local_root)
            out, _ = job.communicate(timeout=300)
            if "No available agent to submit job" not in out:
                break
            time.sleep(5)
        expected = (f"error: CEMLAB_STORAGE {local_root} is only reachable on this host "
                    f"({hosts.a}), but the Ray cluster has nodes at {hosts.b}: give an address "
                    "(or s3:// root) that every node reaches")
        assert job.returncode != 0 and expected in out.splitlines(), out[-3000:]
        assert Ledger(hosts.env["CEMLAB_LEDGER_URL"]).experiment("host-only") is None
        print(f"[two-hosts] a host-only storage root is refused: {expected}")

        packed = _finish(hosts.submit(write_spec(tmp_path, _spec("one-host", "STRICT_PACK"))),
                         tmp_path / "one-host.log")
        one = _row(hosts, "one-host")
        assert one.status == Status.FINISHED, packed[-3000:]
        client = MlflowClient(hosts.env["MLFLOW_TRACKING_URI"])
        same_host = client.get_run(one.mlflow_run_id).data.tags["ray.nodes"].split(",")
        assert {r.split("@")[1] for r in same_host} == {hosts.a}

        # The same trial across both hosts; host B lost mid-trial, then its node brought back.
        storage = StorageRoot(uri=hosts.storage, endpoint_url=hosts.s3_endpoint)
        job = hosts.submit(write_spec(tmp_path, _spec("two-hosts", "STRICT_SPREAD")))
        checkpoints = f"ray_results/trials/two-hosts/trial-{one.trial_hash}"
        deadline = time.monotonic() + 600
        while not _registered_checkpoint(storage, checkpoints):
            assert job.poll() is None, "the job ended before its first checkpoint"
            assert time.monotonic() < deadline, "no checkpoint in S3 within 600 s"
            time.sleep(0.5)
        hosts.kill_b()
        print("[two-hosts] host B killed (SIGKILL, all its processes) once Ray Train had "
              "registered a checkpoint in S3; restarting its node")
        hosts.start_b()
        out = _finish(job, tmp_path / "two-hosts.log")
        two = _row(hosts, "two-hosts")
        assert two.status == Status.FINISHED and two.trial_hash == one.trial_hash, out[-3000:]
        resumed = [ln for ln in out.splitlines() if "resumed from step" in ln]
        assert resumed, f"no resume in the job's log: {tmp_path / 'two-hosts.log'}"
        assert two.checkpoint_path.startswith(storage.uri_of(checkpoints))
        runs = client.search_runs([client.get_experiment_by_name("two-hosts").experiment_id],
                                  f"tags.`{ROLE_TAG}` = 'trial'")
        assert [r.info.run_id for r in runs] == [two.mlflow_run_id]  # the same MLflow run
        steps = [m.step for m in client.get_metric_history(two.mlflow_run_id, "val_loss")]
        assert sorted(steps) == list(range(20, STEPS + 1, 20))  # each validation once
        # With STRICT_SPREAD its ranks ran on both hosts (after the restart: B's new node).
        ranks = client.get_run(two.mlflow_run_id).data.tags["ray.nodes"].split(",")
        assert {r.split("@")[1] for r in ranks} == {hosts.a, hosts.b}
        assert len({r.split("@")[0] for r in ranks}) == 2
        assert {r.split("@")[0] for r in ranks} <= {n["id"] for n in hosts.alive_nodes()}
        # Resumed where it was, and two hosts compute what one does: the test perplexity of the
        # interrupted two-host trial is the uninterrupted one-host trial's.
        rel = abs(two.metric - one.metric) / one.metric
        print(f"[two-hosts] placement: ranks on {ranks}; after the kill: "
              f"{resumed[0].split('[train] ')[-1]}; finished in the same job and MLflow run "
              f"{two.mlflow_run_id} (validations at steps {steps})")
        print(f"[two-hosts] test perplexity: two hosts, host B lost and back {two.metric:.6f}, "
              f"one host uninterrupted {one.metric:.6f}, relative difference {rel:.2e}")
        assert rel <= 1e-6

        # Host B kept to itself: A's home is not visible there, and B fetched the corpus from
        # S3 into the node-local home its join chose ($HOME/.cache/cemlab).
        assert hosts.on_b("test", "-e", str(hosts.home / "host-a-marker")).returncode == 1
        b_home = hosts.on_b("find", f"{B_HOME}/.cache/cemlab", "-name",
                            "manifest.json").stdout.split()
        assert any("/data/corpus-" in p for p in b_home), b_home
        assert (hosts.home / "host-a-marker").exists()


def _registered_checkpoint(storage: StorageRoot, under: str) -> bool:
    """Whether Ray Train's checkpoint manager of the run ``under`` the root lists a checkpoint
    (its files are uploaded before it is registered: only a registered one is resumed from)."""
    fs, _ = storage.filesystem()
    try:
        with fs.open_input_stream(storage.path(under, "checkpoint_manager_snapshot.json")) as f:
            return "checkpoint_" in f.read().decode()
    except (FileNotFoundError, OSError):
        return False
