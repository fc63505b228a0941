"""End to end: local services, `python -m orchestrator run` on tiny grids.

Starts its own Ray head (token auth) and MLflow server (basic auth) with infra/local/up.sh in a
temporary CEMLAB_HOME; runs a 2 x 2 learning-rate grid through Ray Tune (2 Ray Train workers and
DeepSpeed ZeRO-2 per trial), checks MLflow, the ledger, the Akima results and the registry,
submits the same trials under another name through `ray job submit` (the trial cache copies
them); kills a run mid-trial and resumes it; fails one trial of two (its worker killed, no
restarts); runs the GP workload's adaptive bracket and evaluation round; stops the services.
"""

import ipaddress
import json
import math
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from orchestrator.planning.spec import parse_spec
from orchestrator.records.ledger import Ledger, Status
from orchestrator.records.model_registry import download_model, model_id_of
from orchestrator.records.tracking import CODE_TAG, COMMIT_TAG, LR_ROUND_TAG
from orchestrator.science.analysis import akima_optimum
from tests.conftest import RAY_CLUSTER
from tests.orchestrator.conftest import (
    ROOT,
    orchestrator,
    orchestrators,
    stack_logs,
    start_orchestrator,
    write_spec,
)
from workloads.core.architecture import CEM_BEST
from workloads.core.pack import parse_name
from workloads.core.provenance import code_fingerprint, git_commit
from workloads.models import flops_per_token, parameter_counts
from workloads.runtime.optim import lr_factor

pytestmark = [pytest.mark.slow, RAY_CLUSTER]

SPEC = {
    "name": "e2e",
    "data": {"source": "shakespeare", "vocab_size": 512},
    "sizes": ["nano"],
    "variants": {"llama": {"attention": "llama", "mlp": "llama"},
                 "cem": CEM_BEST},  # T = 2, shared diagonal, diag-plus-low-rank preconditioners
    "learning_rates": [0.004, 0.008],
    "budget": {"tokens": 40960},
    "training": {"batch_size": 16, "micro_batch_size": 8, "eval_interval": 20,
                 "eval_sequences": 32, "log_interval": 5, "energy_diagnostics": True},
    "engine": {"zero_stage": 2},
    "resources": {"num_workers": 2, "cpus_per_worker": 1},
}


SUBMIT_RUN = ["ray", "job", "submit", "--working-dir", ".", "--", "python", "-m", "orchestrator",
              "run"]  # and a spec: `cemlab run` through Ray's job server


def checkpointed_step(ledger: Ledger, experiment: str, rank: int = 0,
                      trial: str | None = None) -> int:
    """The newest step rank ``rank`` has written a checkpoint of, in trial ``trial`` (its hash)
    of ``experiment``, else in its first trial (0: none yet)."""
    exp = ledger.experiment(experiment)
    rows = [r for r in (ledger.trials(exp.id) if exp else [])
            if trial is None or r.trial_hash == trial]
    if not rows or not rows[0].checkpoint_path:
        return 0
    manifests = Path(rows[0].checkpoint_path).glob(f"checkpoint_*/manifest-rank{rank}.json")
    return max((json.loads(m.read_text())["step"] for m in manifests), default=0)


def train_workers(home: Path) -> list:
    """The Ray Train worker processes (``psutil.Process``) under the Ray head of the local stack
    in ``home``: a search of its process tree, so that another Ray cluster on the host (another
    test's, a study's) is neither counted nor killed."""
    import psutil

    head = psutil.Process(int((home / "run" / "ray.pid").read_text()))
    workers = []
    for process in head.children(recursive=True):
        try:
            if "RayTrainWorker" in " ".join(process.cmdline()):
                workers.append(process)
        except psutil.NoSuchProcess:  # ended while the tree was read
            pass
    return workers


def committed_checkpoints(ledger: Ledger, experiment: str) -> list[str]:
    """The checkpoints Ray Train has committed (every rank reported) in the run of the running
    trials of ``experiment`` (a pack's run holds all its trials'), oldest first, from its
    checkpoint manager's snapshot."""
    exp = ledger.experiment(experiment)
    running = [r for r in (ledger.trials(exp.id) if exp else [])
               if r.status == "RUNNING" and r.checkpoint_path]
    if not running:
        return []  # the run directory is recorded at a trial's first checkpoint there
    snapshot = Path(running[0].checkpoint_path) / "checkpoint_manager_snapshot.json"
    text = snapshot.read_text() if snapshot.exists() else ""
    return sorted(set(re.findall(r"checkpoint_\w+?_\d{9}_\d+", text)))


def wait_for_checkpoint(job: subprocess.Popen, ledger: Ledger, experiment: str, rank: int,
                        step: int, trial: str | None = None) -> None:
    """Wait (up to 300 s, while ``job`` runs) for ``checkpointed_step`` to reach ``step``."""
    deadline = time.monotonic() + 300
    while checkpointed_step(ledger, experiment, rank, trial) < step:
        assert job.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)


def test_grid_trains_tracks_analyses_and_registers(services, tmp_path):
    home, env = services
    spec_path = write_spec(tmp_path, SPEC)
    assert (home / "ray_auth_token").stat().st_mode & 0o077 == 0  # the token is private

    proc = orchestrator(env, "run", str(spec_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "results of 'e2e'" in proc.stdout and "Akima optima" in proc.stdout

    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name("e2e")
    runs = client.search_runs([exp.experiment_id])
    (parent,) = [r for r in runs if r.data.tags["cemlab.role"] == "experiment"]
    trials = [r for r in runs if r.data.tags["cemlab.role"] == "trial"]
    assert sorted(r.info.run_name for r in trials) == [
        f"{v}@nano lr={lr} seed=0" for v in ("cem", "llama") for lr in (0.004, 0.008)]
    # Neither the Ray token nor MLflow's password reaches MLflow (params, tags, the spec
    # artifact) or the logs (the driver's, and every Ray and MLflow log of the stack).
    secrets = [(home / name).read_text().strip()
               for name in ("ray_auth_token", "mlflow_admin_password")]
    logs = stack_logs(home, env)
    spec_artifact = Path(client.download_artifacts(parent.info.run_id, "spec.yaml",
                                                   str(tmp_path))).read_text()
    for secret in secrets:
        for run in runs:
            assert secret not in json.dumps([run.data.params, run.data.tags])
        assert secret not in spec_artifact + proc.stdout + proc.stderr + logs
    spec = parse_spec(SPEC)
    steps = 40960 // (16 * 64)
    for run in trials:
        m, p = run.data.metrics, run.data.params
        assert run.info.status == "FINISHED"
        assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id
        variant, peak = run.data.tags["variant"], float(p["lr"])
        cfg = spec.variants[variant].resolve("nano", 512)
        counts = parameter_counts(cfg)
        assert {k: int(m[f"params_{k}"]) for k in counts} == counts
        assert p["model.attention"] == variant and p["engine.zero_stage"] == "2"
        assert p["training.grad_accum"] == "1" and p["training.micro_batch"] == "8"
        assert m["tokens_seen"] == steps * 16 * 64
        assert m["test_perplexity"] == pytest.approx(math.exp(m["test_loss"]), rel=1e-6)
        assert m["val_perplexity"] == pytest.approx(math.exp(m["val_loss"]), rel=1e-6)
        assert m["flops_per_token"] == pytest.approx(flops_per_token(cfg, 64))
        assert m["flops_per_s"] == pytest.approx(m["tokens_per_s"] * m["flops_per_token"])
        # Where its wall time went: the phases close to the driver's total.
        phases = [m[f"time/{p}_s"] for p in ("startup", "train", "eval", "checkpoint",
                                             "teardown")]
        assert m["time/compile_s"] == 0  # engine.compile: auto compiles on GPUs only
        assert all(s > 0 for s in phases) and sum(phases) == pytest.approx(m["time/total_s"])
        assert m["time/train_s"] < m["train_wall_s"] < m["time/total_s"]
        # MFU over the train steps: the analytic FLOPs of every step over the train phase.
        assert m["train_mfu"] == pytest.approx(
            m["flops_per_token"] * steps * 16 * 64 / m["time/train_s"] / m["peak_flops_per_s"],
            rel=1e-6)
        assert 0 < m["train_mfu"] < 1 and m["peak_memory_mib"] > 100
        if variant == "cem":  # energy diagnostics reached MLflow, for every layer and step
            for layer, name, t in [(0, "attn", 0), (1, "attn", 2), (1, "mlp", 2)]:
                assert math.isfinite(m[f"energy/{name}/layer{layer}/step{t}"])
            assert m["precond_min_eig/mlp/layer1"] > 0
        else:
            assert not any(k.startswith("energy/") for k in m)
        loss = [x.value for x in client.get_metric_history(run.info.run_id, "loss")]
        assert len(loss) == steps
        assert sum(loss[-5:]) / 5 < sum(loss[:5]) / 5 - 0.5  # the loss goes down
        lr = {x.step: x.value for x in client.get_metric_history(run.info.run_id, "lr")}
        for step in (1, steps // 2, steps):  # the schedule that ran is the paper's schedule
            assert lr[step] == pytest.approx(peak * lr_factor(step - 1, steps, 0.05, 0.1),
                                             rel=1e-6)

    # The ledger holds one finished row per trial, with its run and its last checkpoint.
    ledger = Ledger(env["CEMLAB_LEDGER_URL"])
    rows = ledger.trials(ledger.experiment("e2e").id)
    by_run = {r.info.run_id: r for r in trials}
    assert len(rows) == 4 and {r.status for r in rows} == {Status.FINISHED}
    for row in rows:
        run = by_run[row.mlflow_run_id]
        assert run.data.tags["cemlab.trial_id"] == row.trial_hash
        assert row.metric == pytest.approx(run.data.metrics["test_perplexity"])
        assert row.val_metric == pytest.approx(run.data.metrics["val_perplexity"])
        assert run.data.tags[COMMIT_TAG] == git_commit()  # provenance on every run
        assert run.data.tags[CODE_TAG] == code_fingerprint()
        assert Path(row.checkpoint_path).is_dir() and row.finished_at >= row.started_at

    # Akima optima: on the parent run (metrics and table) and from `results`.
    parent = client.get_run(parent.info.run_id)
    assert parent.info.status == "FINISHED"
    for variant in ("llama", "cem"):  # the optimum of the ledger's own metrics, recomputed
        mine = sorted((r.lr, r.val_metric, r.metric) for r in rows if r.variant == variant)
        expected = akima_optimum([lr for lr, _, _ in mine], [v for _, v, _ in mine])
        assert parent.data.metrics[f"shakespeare/{variant}/nano/opt_lr"] == pytest.approx(
            expected.lr)
        # Two LRs: the validation optimum is one of them; test is that trial's.
        (chosen,) = [t for lr, _, t in mine if lr == pytest.approx(expected.lr)]
        assert parent.data.metrics[f"shakespeare/{variant}/nano/opt_perplexity"] == (
            pytest.approx(chosen))
        # The grid's best trial has learned: under half the perplexity of the uniform
        # distribution over its 512 tokens (40k tokens are too few to beat the unigram floor).
        assert min(t for _, _, t in mine) < 512 / 2
    table = json.loads(Path(client.download_artifacts(parent.info.run_id, "akima_optima.json",
                                                      str(tmp_path))).read_text())
    assert len(table["data"]) == 2
    results, status = orchestrators(env, ("results", str(spec_path)),
                                    ("status", str(spec_path)))
    assert results.returncode == 0 and "optimal LR" in results.stdout
    # Two learning rates bracket nothing: every optimum is flagged as sitting at a grid edge.
    assert results.stdout.count("optimum at a grid edge (seed 0)") == 2
    split = re.search(r"time split of 4 finished trial\(s\): (\d+)% in train steps", status.stdout)
    total_train = sum(r.data.metrics["time/train_s"] for r in trials)
    total = sum(r.data.metrics["time/total_s"] for r in trials)
    assert split and int(split.group(1)) == round(100 * total_train / total), status.stdout
    for variant in ("llama", "cem"):  # MFU mean and peak memory per variant, from MLflow
        runs = [r.data.metrics for r in trials if r.data.tags["variant"] == variant]
        mfu = sum(m["train_mfu"] for m in runs) / len(runs)
        memory = max(m["peak_memory_mib"] for m in runs)
        assert re.search(rf"{variant} +nano +2 +{100 * mfu:.1f}% .* {memory:,.0f} MiB",
                         status.stdout), status.stdout
    print(next(line for line in status.stdout.splitlines() if "time split" in line))

    # Every trial's model is a logged model of its run (the experiment's Models view); the
    # best per (variant, size), on validation, is registered from it; `models eval`
    # reproduces its test perplexity.
    models = {m.source_run_id: m for m in client.search_logged_models([exp.experiment_id])}
    assert sorted(models) == sorted(r.info.run_id for r in trials)
    assert {(m.name, str(m.status)) for m in models.values()} == {("model", "READY")}
    for variant in ("llama", "cem"):
        best = min((r for r in trials if r.data.tags["variant"] == variant),
                   key=lambda r: r.data.metrics["val_perplexity"])
        version = client.get_model_version_by_alias(f"cemlab-{variant}-nano", "best")
        assert version.run_id == best.info.run_id
        assert model_id_of(version) == models[best.info.run_id].model_id
        assert version.source == f"models:/{models[best.info.run_id].model_id}"
        assert version.tags["trial_id"] == best.data.tags["cemlab.trial_id"]
        assert int(version.tags["params_total"]) == int(best.data.metrics["params_total"])
    again_path = write_spec(tmp_path, {**SPEC, "name": "e2e-again"})  # the same trials
    job = subprocess.Popen(  # in another experiment, through the job server: checked below
        [*SUBMIT_RUN, str(again_path)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    # The models commands, at once: each reads the registry; the two evaluations each store a
    # tag of their own on the version.
    cem = "cemlab-cem-nano@best"
    generate = ("models", "generate", cem, "To be, or not", "--max-new-tokens", "24",
                "--seed", "1")
    evaluated, deeper, probed, listed, generated, again, exported, refused = orchestrators(
        env, ("models", "eval", cem),
        ("models", "eval", cem, "--attn-steps", "4", "--mlp-steps", "4",
         "--step-size-scale", "0.5"),  # test-time recursion: T=2 trained, T=4 at eta / 2
        ("models", "probe", cem, "--sequences", "4"), ("models", "list"), generate, generate,
        ("models", "export", "cemlab-llama-nano@best", "--format", "hf", str(tmp_path / "hf")),
        ("models", "export", cem, str(tmp_path / "c")))
    assert evaluated.returncode == 0, evaluated.stdout + evaluated.stderr[-2000:]
    assert "within 0.001" in evaluated.stdout
    version = client.get_model_version_by_alias("cemlab-cem-nano", "best")
    recomputed = float(version.tags["test_perplexity_recomputed"])  # stored on the version
    assert recomputed == pytest.approx(float(version.tags["test_perplexity"]), rel=1e-3)
    # test-time recursion: the T=2 model at T=4 with eta halved, stored beside
    assert deeper.returncode == 0, deeper.stdout + deeper.stderr[-2000:]
    assert "at test-time recursion attn4_mlp4_eta0.5" in deeper.stdout
    version = client.get_model_version_by_alias("cemlab-cem-nano", "best")
    at_four = float(version.tags["test_perplexity_attn4_mlp4_eta0.5"])
    assert math.isfinite(at_four) and at_four != recomputed
    assert probed.returncode == 0, probed.stdout + probed.stderr[-2000:]
    table = probed.stdout.split("kl_to_prior", 1)[1].splitlines()[2:]  # nano: 2 layers x T=2
    assert [tuple(line.split()[:2]) for line in table] == [
        ("0", "1"), ("0", "2"), ("1", "1"), ("1", "2")]
    assert all(float(line.split()[-1]) >= 0 for line in table)
    assert "cemlab-llama-nano" in listed.stdout and "cemlab-cem-nano" in listed.stdout
    assert "registered (UTC)" in listed.stdout and "test ppl" in listed.stdout
    assert generated.returncode == 0, generated.stderr[-2000:]
    sample = generated.stdout  # the prompt and its continuation (which may hold newlines)
    assert sample.startswith("To be, or not") and len(sample) > len("To be, or not") + 10
    assert sample == again.stdout  # seeded
    print(f"models generate cemlab-cem-nano@best: {sample!r}")
    card = download_model(version, env["MLFLOW_TRACKING_URI"], tmp_path / "card") / "README.md"
    assert version.tags["trial_id"] in card.read_text()

    # A Llama baseline exports to Hugging Face with our logits.
    import transformers

    from workloads.lm.package import load_decoder
    from workloads.lm.workload import package_dir

    assert exported.returncode == 0, exported.stderr[-2000:]
    llama = client.get_model_version_by_alias("cemlab-llama-nano", "best")
    # The weights as trained (bf16 here), both models computing in fp32: the mapping is exact.
    model_dir = download_model(llama, env["MLFLOW_TRACKING_URI"], tmp_path / "dl")
    ours = load_decoder(package_dir(model_dir), dtype=torch.float32)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf",
                                                       dtype=torch.float32).eval()
    x = torch.randint(512, (2, 64))
    with torch.no_grad():
        difference = (ours(x) - hf(x).logits).abs().max().item()
    print(f"Hugging Face export: max |logits difference| {difference:.2e}")
    assert difference < 1e-4
    assert refused.returncode == 2 and "only Llama baselines" in refused.stderr

    # The same trials in another experiment, through the job server (submitted with the models
    # commands): each is copied from the ledger through the trial cache, none trains again,
    # and each model stays registered once.
    out, err = job.communicate(timeout=600)
    assert job.returncode == 0, out[-3000:] + err[-3000:]
    assert out.count("cached, trained in experiment 'e2e'") == 4 and "Ray Tune" not in out
    copies = ledger.trials(ledger.experiment("e2e-again").id)
    sources = {r.id: r for r in rows}
    assert len(copies) == 4 and {r.status for r in copies} == {Status.FINISHED}
    for copy in copies:
        source = sources[copy.source_trial_id]
        assert (copy.metric, copy.val_metric) == (source.metric, source.val_metric)
        copied = client.get_run(copy.mlflow_run_id)
        assert copied.data.tags["cemlab.cached_from"] == source.mlflow_run_id
        assert copied.data.metrics["time/total_s"] == 0.0
    assert len(client.search_runs([exp.experiment_id])) == 5
    assert len(client.search_model_versions("name = 'cemlab-cem-nano'")) == 1
    status = orchestrator(env, "status", str(again_path))
    assert status.stdout.count("(cached)") == 4, status.stdout


JOB_START_TIMES = """
import json, sys
from ray.job_submission import JobSubmissionClient, JobType
jobs = JobSubmissionClient().list_jobs()
print(json.dumps([j.start_time / 1000 for j in jobs
                  if j.type == JobType.SUBMISSION and sys.argv[1] in j.entrypoint]))
"""


def test_a_bf16_trial_submitted_twice_trains_once_then_survives_its_killed_worker_and_driver(
        services, tmp_path):
    """A 100-step bf16 trial of 2 Ray Train workers (ZeRO-2), submitted twice at once with
    ``ray job submit``: one submission trains it, uninterrupted, the other waits for it; each
    says what it left and why, one MLflow run holds every step once. The same trial again, in
    an experiment of its own: one of its two worker processes is SIGKILLed once Ray Train has
    committed a checkpoint, and Ray Train restarts the group in the same submission, from that
    checkpoint. A checkpoint later the submitting driver itself is SIGKILLed, and the newest
    checkpoint corrupted. The resubmission waits out the dead driver's lease, takes the trial
    over, passes over the corrupt checkpoint to the previous one and finishes in the same
    MLflow run: every step logged once, and the uninterrupted trial's validation and test
    perplexity to the bit (data order, RNG states and the LR schedule all restored)."""
    home, env = services
    spec = {**SPEC, "name": "bf16-reference", "variants": {"llama": {}},
            "learning_rates": [0.005],
            "budget": {"tokens": 100 * 16 * 64},  # 100 steps, a checkpoint every 20
            "training": {**SPEC["training"], "eval_sequences": 8, "energy_diagnostics": False},
            "engine": {"zero_stage": 2, "precision": "bf16"}}
    reference_path = write_spec(tmp_path, spec)
    jobs = [subprocess.Popen([*SUBMIT_RUN, str(reference_path)], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for _ in range(2)]
    outputs = [job.communicate(timeout=900)[0] for job in jobs]
    assert [job.returncode for job in jobs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    ledger = Ledger(env["CEMLAB_LEDGER_URL"])
    (uninterrupted,) = ledger.trials(ledger.experiment("bf16-reference").id)
    assert uninterrupted.status == Status.FINISHED and uninterrupted.lease_owner is None
    claimed = [re.findall(r"\((\w{12})\): claimed by", o) for o in outputs]
    assert sorted(claimed, key=len) == [[], [uninterrupted.trial_hash]]  # by one of the two
    waited = outputs[claimed.index([])]  # and the other said why it left it, and waited
    assert re.search(rf"\({uninterrupted.trial_hash}\): held by \S+ until .* which trains it",
                     waited) and "waiting for 1 trial(s)" in waited, waited[-3000:]
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    runs = client.search_runs([client.get_experiment_by_name("bf16-reference").experiment_id])
    (run,) = [r for r in runs if r.data.tags.get("cemlab.role") == "trial"]
    assert len(runs) == 2 and run.info.run_id == uninterrupted.mlflow_run_id  # and a parent
    # The first step counts from the submission as Ray's job server recorded it, so the job's
    # runtime environment and its driver's start count too.
    listed = subprocess.run([sys.executable, "-c", JOB_START_TIMES, str(reference_path)],
                            env=env, text=True, capture_output=True, timeout=120)
    assert listed.returncode == 0, listed.stderr[-2000:]
    submitted = json.loads(listed.stdout)  # UNIX s of each submission
    assert len(submitted) == 2
    losses = client.get_metric_history(run.info.run_id, "loss")
    assert sorted(x.step for x in losses) == list(range(1, 101))  # trained once
    step_1_done = next(x.timestamp for x in losses if x.step == 1) / 1000
    first_step_s = run.data.metrics["time/first_step_s"]
    assert step_1_done - max(submitted) - 2 < first_step_s < step_1_done - min(submitted)
    versions = client.search_model_versions(
        f"name = 'cemlab-llama-nano' and run_id = '{run.info.run_id}'")
    assert len(versions) == 1  # both submissions register; one version per run stays

    spec_path = write_spec(tmp_path, {**spec, "name": "bf16-killed"})
    log = tmp_path / "bf16-killed.log"  # a file, not a pipe that nobody reads while it runs
    first = start_orchestrator(  # the same trial again: trained, not copied from the reference
        {**env, "CEMLAB_LEASE_S": "30"},  # its lease lapses <= 30 s after its death
        "run", "--no-cache", str(spec_path), out=log)

    def newest_committed() -> int:  # the step of Ray Train's newest committed checkpoint
        return max((parse_name(name)[1] for name in committed_checkpoints(
            ledger, "bf16-killed")), default=0)

    def wait_for(step: int) -> None:
        deadline = time.monotonic() + 300
        while newest_committed() < step:
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)

    # Only once Ray Train has committed a checkpoint (every rank reported it, and its controller
    # recorded it) is there one to resume from: a kill before that rightly restarts at step 0.
    wait_for(1)
    workers = train_workers(home)  # the trial's two ranks
    assert len(workers) == 2, workers
    workers[1].kill()  # SIGKILL one training process; the driver and the other rank live on
    killed_at = newest_committed()
    assert killed_at <= 40, "too late a kill: nothing left to test"
    wait_for(killed_at + 20)  # a checkpoint after the restart: 60 steps or more still to go
    first.send_signal(signal.SIGKILL)  # the driver dies; Ray tears down its trial
    first.wait()
    output = log.read_text()
    # In the same submission, from the last checkpoint Ray Train had committed (all ranks).
    assert "Attempting to start training worker group" in output
    assert f"resumed from step {killed_at} " in output, output[-3000:]
    (row,) = ledger.trials(ledger.experiment("bf16-killed").id)
    assert row.status == Status.RUNNING and row.mlflow_run_id
    # Corrupt the newest checkpoint: the resubmitted trial must pass over it to the previous one.
    previous, newest = (Path(row.checkpoint_path) / c for c in committed_checkpoints(
        ledger, "bf16-killed")[-2:])
    shard = sorted((newest / "ckpt").glob("*optim_states.pt"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    previous_step = json.loads((previous / "manifest-rank0.json").read_text())["step"]

    again = orchestrator(env, "run", str(spec_path))
    output = again.stdout + again.stderr
    assert again.returncode == 0, output[-3000:]
    # The dead driver's lease held the trial until it lapsed; then this submission took it over.
    held = re.search(r"\): held by (\S+) until .* UTC, which trains it", output)
    taken = re.search(r"\): claimed by \S+, taken over from (\S+), whose lease expired", output)
    assert held and taken and held.start() < taken.start(), output[:3000]
    assert held.group(1) == taken.group(1)  # the dead driver's lease
    assert re.search(rf"{newest.name}.*is corrupt \(sha256 differs from its manifest\); "
                     "trying the previous one", output), output[-3000:]
    resumed = [line for line in output.splitlines() if "resumed from step" in line]
    assert resumed and f"resumed from step {previous_step} " in resumed[0], output[-3000:]
    (row,) = ledger.trials(ledger.experiment("bf16-killed").id)
    assert row.trial_hash == uninterrupted.trial_hash and row.status == Status.FINISHED
    assert (row.metric, row.val_metric) == (uninterrupted.metric, uninterrupted.val_metric)
    print(f"bf16, its worker killed after step {killed_at}, its driver after step "
          f"{killed_at + 20}, resumed from step {previous_step}: val {row.val_metric!r}, test "
          f"{row.metric!r}; uninterrupted: val {uninterrupted.val_metric!r}, test "
          f"{uninterrupted.metric!r}")
    exp = client.get_experiment_by_name("bf16-killed")
    trial_runs = client.search_runs([exp.experiment_id], "tags.`cemlab.role` = 'trial'")
    assert [r.info.run_id for r in trial_runs] == [row.mlflow_run_id]  # one run, reused
    assert trial_runs[0].info.status == "FINISHED"
    # Every step exactly once: the steps replayed after a checkpoint are not logged again (the
    # run already had them), and none is missing.
    for key in ("loss", "lr", "tokens_seen"):
        steps = sorted(x.step for x in client.get_metric_history(row.mlflow_run_id, key))
        assert steps == list(range(1, 101)), key
    val_steps = sorted(x.step for x in client.get_metric_history(row.mlflow_run_id, "val_loss"))
    assert val_steps == list(range(20, 101, 20))


def test_a_study_loses_nothing_to_killed_workers_and_goes_on_from_its_bundle_bit_identical(
        services, tmp_path):
    """A study of four trials (2 learning rates x 2 seeds) that one worker group trains as two
    stacks of two in turn (one pack). Its worker is SIGKILLed as soon as the first stack is
    FINISHED: the restarted group finds both members' final checkpoints, reports them again
    untrained, and trains the second stack. A result bundle exported then holds the first
    stack alone. The second stack's worker is SIGKILLed too, once each of its members has a
    checkpoint Ray Train committed: the group restarts, and every member resumes from its own
    checkpoint, all at one step, each step logged once in its own run. A fresh ledger (another
    machine's) imports the bundle, and `cemlab run` there trains only the second stack,
    uninterrupted: to the bit what the resumed stack gave."""
    from orchestrator.records.bundles import export_bundle

    home, env = services
    steps = 100  # a checkpoint every 20: the second kill leaves 40 steps or more to train
    spec = {**SPEC, "name": "resumable", "variants": {"llama": {}},
            "learning_rates": [0.002, 0.006], "seeds": [0, 1],
            "budget": {"tokens": steps * 16 * 64},
            "training": {**SPEC["training"], "eval_sequences": 8, "energy_diagnostics": False},
            "resources": {"num_workers": 1, "cpus_per_worker": 2,  # one group: one pack
                          "stack": 2}}  # of two stacks of two, in turn
    spec_path = write_spec(tmp_path, spec)
    log = tmp_path / "resumable.log"  # a file, not a pipe that nobody reads while it runs
    job = start_orchestrator(env, "run", "--no-cache", str(spec_path),  # trained, not copied
                             out=log)
    ledger = Ledger(env["CEMLAB_LEDGER_URL"])

    def rows() -> list:
        exp = ledger.experiment("resumable")
        return ledger.trials(exp.id) if exp else []

    def wait(ready, what: str) -> None:
        deadline = time.monotonic() + 300
        while not ready():
            assert job.poll() is None, f"the study ended before {what}: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"not {what} within 300 s"
            time.sleep(0.05)

    wait(lambda: sum(r.status == Status.FINISHED for r in rows()) >= 2, "its first stack")
    first = {r.trial_hash: r for r in rows() if r.status == Status.FINISHED}
    (worker,) = train_workers(home)
    worker.kill()  # before the second stack, or early in its 100 steps
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    bundle = tmp_path / "results" / "resumable"
    manifest = export_bundle(ledger, ["resumable"], bundle, client)
    assert manifest.trials == 2, manifest  # the restarted group has trained nothing yet
    second = {r.trial_hash for r in rows()} - set(first)
    assert len(first) == len(second) == 2, "the stacks are not two of two"

    def second_committed() -> list[tuple[str, int, int]]:  # the second stack's, parsed
        return [c for c in map(parse_name, committed_checkpoints(ledger, "resumable"))
                if c[0] in second]

    wait(lambda: len({trial for trial, _, _ in second_committed()}) == 2,
         "a checkpoint of each member of its second stack")
    (worker,) = train_workers(home)
    worker.kill()
    newest = max(step for _, step, _ in second_committed())
    assert newest < steps, "the second stack had finished before the kill: nothing was tested"
    job.wait(timeout=600)
    output = log.read_text()
    assert job.returncode == 0, output[-3000:]
    done = {r.trial_hash: r for r in rows()}
    assert len(done) == 4 and {r.status for r in done.values()} == {Status.FINISHED}
    assert output.count("a stack of 2 trials") >= 2, output[-3000:]  # each stack, stacked
    # Both restarts found the first stack trained and reported its members again, untrained.
    assert output.count("Attempting to start training worker group") >= 2, output[-3000:]
    assert output.count("trained already") == 4, output[-3000:]
    for trial, before in first.items():
        assert re.search(rf"checkpoint_{trial}_{steps:09d}_\d+\): reported again", output)
        again = done[trial]
        assert (again.metric, again.val_metric, again.checkpoint_path) == (
            before.metric, before.val_metric, before.checkpoint_path)
    # each member of the second stack from its own checkpoint, all at one step (the last two:
    # a kill between two members' checkpoints first restores, then takes both back to the step
    # each has)
    resumed = re.findall(r"resumed from step (\d+) ", output)[-2:]
    assert len(resumed) == 2 and len(set(resumed)) == 1, output[-3000:]
    assert int(resumed[0]) in range(20, steps, 20)
    for row in done.values():  # every step of each trial once, each in its own run
        for key in ("loss", "lr", "tokens_seen"):
            logged = sorted(x.step for x in client.get_metric_history(row.mlflow_run_id, key))
            assert logged == list(range(1, steps + 1)), (row.trial_hash, key)
        assert Path(row.checkpoint_path).is_dir()
    assert len({r.mlflow_run_id for r in done.values()}) == 4
    # the final checkpoints of all three attempts' trials kept in the pack's one run directory
    assert len({Path(r.checkpoint_path).parent for r in done.values()}) == 1

    fresh = {**env, "CEMLAB_LEDGER_URL": f"sqlite:///{tmp_path / 'fresh-ledger.db'}"}
    imported = orchestrator(fresh, "import", str(bundle.parent))
    assert imported.returncode == 0, imported.stderr[-3000:]
    again = orchestrator(fresh, "run", str(spec_path))
    output = again.stdout + again.stderr
    assert again.returncode == 0, output[-3000:]
    skipped = re.findall(r"\((\w{12})\): finished, skipped", output)
    claimed = re.findall(r"\((\w{12})\): claimed by", output)
    assert sorted(skipped) == sorted(first) and sorted(claimed) == sorted(second), output[-3000:]
    assert "resumed from step" not in output  # trained from its start, uninterrupted
    elsewhere = Ledger(fresh["CEMLAB_LEDGER_URL"]).trials(1)
    assert len(elsewhere) == 4 and all(r.status == Status.FINISHED for r in elsewhere)
    for row in elsewhere:  # as the first machine had them: imported, or trained alike
        before = done[row.trial_hash]
        assert (row.metric, row.val_metric) == (before.metric, before.val_metric), row.trial_hash
    print(f"second stack killed after step {resumed[0]}: test perplexities "
          f"{sorted(done[t].metric for t in second)}, as trained uninterrupted elsewhere")


def test_a_failed_trial_is_recorded_and_the_next_loses_no_metric_point_to_a_tracking_outage(
        services, tmp_path):
    """Two trials of one submission in turn, no restarts allowed. The first's only worker is
    killed after its first checkpoint: it is recorded FAILED and the second goes on. Once the
    second has checkpointed, the MLflow server's process is stopped until that trial has
    trained to its end and waits for the server to send its last points and its model; then
    the server is started again with its own command line and environment: training went on,
    every point arrives once."""
    import os
    import urllib.request

    import psutil

    home, env = services
    spec = {**SPEC, "name": "one-fails", "variants": {"llama": {}}, "learning_rates": [0.004],
            "seeds": [0, 1],
            "budget": {"tokens": 160 * 16 * 64},  # a checkpoint every 20 steps
            "training": {**SPEC["training"], "eval_sequences": 8, "energy_diagnostics": False},
            "resources": {"num_workers": 1, "cpus_per_worker": 2, "max_failures": 0,
                          "stack": 1}}  # in turn: the stack test fails a stack
    spec_path = write_spec(tmp_path, spec)
    log = tmp_path / "one-fails.log"  # a file, read while the job runs
    job = start_orchestrator(env, "run", str(spec_path), out=log)
    ledger = Ledger(env["CEMLAB_LEDGER_URL"])

    def training() -> str | None:  # one trial at a time: the running one, past a checkpoint
        exp = ledger.experiment("one-fails")
        return next((r.trial_hash for r in (ledger.trials(exp.id) if exp else [])
                     if r.status == Status.RUNNING and r.checkpoint_path
                     and any(Path(r.checkpoint_path).glob("checkpoint_*/manifest-rank0.json"))),
                    None)

    deadline = time.monotonic() + 300
    while (first := training()) is None:  # a worker killed while its group starts is restarted
        assert job.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    workers = train_workers(home)
    assert workers
    for worker in workers:  # the trial's only worker, and no restart allowed
        worker.kill()

    (second,) = {r.trial_hash for r in ledger.trials(ledger.experiment("one-fails").id)} - {
        first}
    wait_for_checkpoint(job, ledger, "one-fails", rank=0, step=20, trial=second)
    pid_file = home / "run" / "mlflow.pid"
    server = psutil.Process(int(pid_file.read_text()))
    cmdline, environ, cwd = server.cmdline(), server.environ(), server.cwd()
    os.killpg(os.getpgid(server.pid), signal.SIGKILL)  # the server and its workers
    server.wait(30)
    stopped = time.monotonic()
    at_stop = checkpointed_step(ledger, "one-fails", trial=second)
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{env['MLFLOW_TRACKING_URI']}/health", timeout=5)
    # The outage lasts until the second trial has trained to its end ("[train] done", the
    # first trial died before its own) and has waited for the server (its /health every 5 s)
    # to send its last points and upload its model: at least 15 s, at most 300 s.
    while "[train] done:" not in log.read_text() or time.monotonic() - stopped < 15:
        assert job.poll() is None and time.monotonic() - stopped < 300
        time.sleep(0.5)
    time.sleep(5)  # past its first probe of the server, whichever way the log was late
    during = checkpointed_step(ledger, "one-fails", trial=second)
    outage_s = time.monotonic() - stopped
    # Started as up.sh starts it (its own session, not this process's child), so down.sh stops it.
    launched = subprocess.run(["bash", "-c", 'setsid "$@" >> "$LOG" 2>&1 < /dev/null & echo $!',
                               "_", *cmdline], env={**environ, "LOG": str(home / "logs" /
                                                                        "mlflow.log")},
                              cwd=cwd, capture_output=True, text=True, check=True)
    pid_file.write_text(launched.stdout)
    job.wait(timeout=600)
    output = log.read_text()
    assert job.returncode == 1, output[-6000:]  # not every trial finished

    rows = {r.trial_hash: r for r in ledger.trials(ledger.experiment("one-fails").id)}
    failed, row = rows[first], rows[second]
    assert (failed.status, row.status) == (Status.FAILED, Status.FINISHED), output[-3000:]
    assert f"({failed.trial_hash}): claimed by" in output
    assert ": FAILED (WorkerGroupError: Training failed due to worker errors" in output
    assert failed.error.startswith("WorkerGroupError: Training failed due to worker errors")
    assert "The actor died unexpectedly" in failed.error  # what the trial raised
    assert all(r.lease_owner is None for r in rows.values())  # settled: released
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    assert client.get_run(failed.mlflow_run_id).info.status == "FAILED"
    parent = client.search_runs([client.get_experiment_by_name("one-fails").experiment_id],
                                "tags.`cemlab.role` = 'experiment'")
    assert [r.info.status for r in parent] == ["FAILED"]
    status = orchestrator(env, "status", str(spec_path))
    assert f"{failed.trial_hash} failed: WorkerGroupError: Training failed" in status.stdout

    assert during > at_stop, (at_stop, during)  # training went on while the server was down
    assert "tracking server unavailable" in output  # the sink kept the points, and said so
    # Nothing went into the outage through MLflow's own retries (urllib3's exponential backoff,
    # which kept the finished trial waiting a minute past the server's return): the model's
    # upload waited for the server's /health like the points did.
    assert "Retrying (Retry(" not in output, output[-3000:]
    for key in ("loss", "lr", "tokens_seen"):  # 0 lost, 0 duplicated
        steps = sorted(x.step for x in client.get_metric_history(row.mlflow_run_id, key))
        assert steps == list(range(1, 161)), key
    val_steps = sorted(x.step for x in client.get_metric_history(row.mlflow_run_id, "val_loss"))
    assert val_steps == list(range(20, 161, 20))
    print(f"outage: stopped at checkpoint step {at_stop}, step {during} checkpointed during the "
          f"{outage_s:.0f} s; {3 * 160} step points and {len(val_steps)} validations, each once")


def test_gp_regression_runs_through_the_same_orchestrator(services, tmp_path):
    """The GP workload's bracket that adapts, then its evaluation round, in one submission.
    With two learning rates each tuning seed's validation optimum lies at one of them (a
    straight line between two points), so round 1 adds the next point beyond that edge (below,
    if either seed's optimum is at the lower one); max_points 3 ends it there. Then seeds 7 and
    8 train at the learning rate the tuning seeds' mean validation chose."""
    home, env = services
    spec = {"name": "gp-e2e", "workload": "gp_regression",
            "gp": {"kernels": ["rbf"], "n_train": 512, "n_val": 64, "n_test": 128,
                   "steps": 150},
            "sizes": ["gp-small"], "variants": {"t1": {"mlp_steps": 1}},
            "learning_rates": {"grid": [0.002, 0.004], "max_points": 3, "eval_seeds": [7, 8]},
            "seeds": [0, 1],
            "training": {"batch_size": 64, "eval_interval": 50},
            # both CPUs to one worker: each round's trials in turn in one worker group, whose
            # start (its Tune and Train actors, its worker) costs far more than their training
            "resources": {"num_workers": 1, "cpus_per_worker": 2}}
    path = write_spec(tmp_path, spec)
    plan = orchestrator(env, "plan", str(path), "--no-calibrate")
    assert "up to 3 per arm: at most 2 more trial(s)" in plan.stdout, plan.stdout
    proc = orchestrator(env, "run", str(path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "optimal rmse" in proc.stdout
    ledger = Ledger(env["CEMLAB_LEDGER_URL"])
    rows = ledger.trials(ledger.experiment("gp-e2e").id)
    assert {r.status for r in rows} == {Status.FINISHED} and len(rows) == 8
    assert {r.dataset for r in rows} == {"gp-rbf"} and not any(r.source_trial_id for r in rows)
    assert all(0 < r.metric < 1.0 for r in rows)  # below the prior's standard deviation
    status, seeds = orchestrators(env, ("status",), ("seeds", str(path)))
    # every experiment of the ledger, this one's counts
    (line,) = [x.split() for x in status.stdout.splitlines() if x.startswith("gp-e2e ")]
    assert line[1:7] == ["gp_regression", "8", "0", "0", "8", "0"]
    tune = [r for r in rows if r.seed in (0, 1)]
    val = {(r.lr, r.seed): r.val_metric for r in tune}
    lrs = sorted({lr for lr, _ in val})
    low = any(val[(0.002, seed)] < val[(0.004, seed)] for seed in (0, 1))
    added = 0.001 if low else 0.008
    assert lrs == sorted([0.002, 0.004, added])
    assert sorted(r.lr_round or 0 for r in tune) == [0, 0, 0, 0, 1, 1]
    assert all(r.lr_round == 1 for r in tune if r.lr == added)
    assert ("round 1: t1@gp-small (gp-rbf) has its validation optimum at an edge of 0.002, "
            f"0.004: adding {added:g} for 2 seed(s)") in proc.stdout, proc.stdout[-3000:]
    assert "round 2" not in proc.stdout  # at max_points
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    by_lr = {r.lr: r for r in tune if r.seed == 0}
    assert client.get_run(by_lr[added].mlflow_run_id).data.tags["cemlab.lr_round"] == "1"
    assert LR_ROUND_TAG not in client.get_run(by_lr[0.002].mlflow_run_id).data.tags
    # The tuning seeds' Akima optima, each seed's own, on the parent run (rmse: the GP's metric)
    parent = client.search_runs([client.get_experiment_by_name("gp-e2e").experiment_id],
                                "tags.`cemlab.role` = 'experiment'")[0]
    optima = [akima_optimum(lrs, [val[(lr, seed)] for lr in lrs]).lr for seed in (0, 1)]
    assert parent.data.metrics["gp-rbf/t1/gp-small/opt_lr"] == pytest.approx(
        statistics.fmean(optima))
    assert parent.data.metrics["gp-rbf/t1/gp-small/opt_lr_std"] == pytest.approx(
        statistics.stdev(optima))
    assert 0 < parent.data.metrics["gp-rbf/t1/gp-small/opt_rmse"] < 1.0
    means = {lr: statistics.fmean(math.log(val[(lr, seed)]) for seed in (0, 1)) for lr in lrs}
    chosen = min(means, key=means.get)
    evals = sorted((r.seed, r.lr) for r in rows if r.seed in (7, 8))
    assert evals == [(7, chosen), (8, chosen)]
    assert (f"evaluation round: t1@gp-small (gp-rbf) chose learning rate {chosen:g} on 2 "
            "tuning seed(s)") in proc.stdout
    assert seeds.returncode == 0, seeds.stderr[-2000:]  # the evaluation seeds' spread
    logs = [math.log(r.metric) for r in rows if r.seed in (7, 8)]
    assert f"{100 * statistics.stdev(logs):.2f}%" in seeds.stdout
    assert "2 evaluation" in seeds.stdout


def test_the_local_stack_listens_on_loopback_only_and_keeps_its_secrets_private(services):
    import psutil

    home, _ = services
    started = [psutil.Process(int((home / "run" / f"{name}.pid").read_text()))
               for name in ("ray", "mlflow")]
    pids = {p.pid for root in started for p in (root, *root.children(recursive=True))}
    listening = [c for c in psutil.net_connections(kind="inet")
                 if c.pid in pids and c.status == psutil.CONN_LISTEN]
    assert len({c.laddr.port for c in listening}) >= 3  # MLflow, Ray GCS, Ray dashboard, ...
    addresses = {ipaddress.ip_address(c.laddr.ip) for c in listening}
    assert all((getattr(a, "ipv4_mapped", None) or a).is_loopback  # ::ffff:127.0.0.1 too
               for a in addresses), listening
    for secret in ("ray_auth_token", "services.env", "mlflow_admin_password", "mlflow_auth.ini",
                   "mlflow_auth.db", "mlflow_flask_secret_key"):
        assert (home / secret).stat().st_mode & 0o777 == 0o600, secret


def test_the_stack_keeps_a_ray_temp_dir_of_its_own(services):
    """Ray's job supervisor points a job's driver at the cluster its temp dir's
    ray_current_cluster names: in the default /tmp/ray, the cluster started last on the host."""
    home, env = services
    temp_dir = Path(env["CEMLAB_RAY_TEMP_DIR"])
    assert temp_dir != Path("/tmp/ray") and str(home) not in str(temp_dir)
    assert (temp_dir / "ray_current_cluster").read_text().strip() == env[
        "CEMLAB_RAY_GCS_ADDRESS"]
    assert list(temp_dir.glob("session_*/logs/raylet.out"))  # the head's logs are there


def test_the_tracking_server_answers_only_authenticated_requests(services):
    import base64
    import urllib.error
    import urllib.request

    home, env = services
    uri, password = env["MLFLOW_TRACKING_URI"], env["MLFLOW_TRACKING_PASSWORD"]
    assert password == (home / "mlflow_admin_password").read_text().strip()

    def status(path: str, user: str | None = None, secret: str = "") -> int:
        request = urllib.request.Request(f"{uri}{path}")
        if user:
            basic = base64.b64encode(f"{user}:{secret}".encode()).decode()
            request.add_header("Authorization", f"Basic {basic}")
        try:
            with urllib.request.urlopen(request, timeout=30) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    search = "/api/2.0/mlflow/experiments/search?max_results=1"
    assert status(search) == 401  # no credentials
    assert status(search, "admin", password + "x") == 401  # a wrong password
    assert status(search, "intruder", password) == 401  # an unknown user
    assert status(search, "admin", password) == 200
    assert status("/health") == 200  # probes and check_tracking need no user
