"""Load test of the local stack: N concurrent ``nano`` trials against MLflow on PostgreSQL.

    python -m infra.local.load                     # 16 trials, Ray with 16 logical CPUs
    python -m infra.local.load --trials 4 --steps 40

Starts its own stack with ``infra/local/up.sh`` in a temporary ``CEMLAB_HOME``: a Ray head
with ``--trials`` logical CPUs (on however many real cores the machine has) and an MLflow server
whose backend store, and so the ledger, is a fresh database on the PostgreSQL server at
``--postgres`` (dropped afterwards). Submits one grid of ``--trials`` Llama ``nano`` trials
(one seed each, one worker of one CPU each, so all run at once) with ``ray job submit``, then
counts:

- every metric point each finished trial should have logged (``expected_points``: loss, lr and
  tokens_seen at every step, throughput every ``log_interval``, validation every
  ``eval_interval`` and at the end, the test metrics once) against what its MLflow run has:
  points lost, and points logged twice;
- ledger rows against MLflow runs: status and run id agree for every trial;
- how many trials ran at once (Tune's limit, from the Ray cluster's CPUs and memory, and the
  peak in the ledger's start and finish times);
- the MLflow server's answers from its access log: requests, and those with a 5xx status
  (server errors) or 429.

Prints one table and exits 1 when a trial did not finish, a point is lost or doubled, or
ledger and MLflow disagree. A benchmark, not part of ``make test``: it takes minutes.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

import sqlalchemy as sa
import yaml
from tabulate import tabulate

from infra.local.services_env import read_services_env

ROOT = Path(__file__).resolve().parents[2]
TRAINING = {"batch_size": 16, "micro_batch_size": 16, "eval_interval": 20, "eval_sequences": 8,
            "log_interval": 5}


def expected_points(steps: int, log_interval: int, eval_interval: int) -> dict[str, set[int]]:
    """The steps at which one language-model trial of ``steps`` optimizer steps logs each
    training metric (``workloads.lm.workload``'s train loop)."""
    every = set(range(1, steps + 1))
    throughput = {s for s in every if s % log_interval == 0 or s == steps}
    validation = {s for s in every if s % eval_interval == 0 and s < steps} | {steps}
    return {"loss": every, "lr": every, "tokens_seen": every,
            "tokens_per_s": throughput, "flops_per_s": throughput,
            "val_loss": validation, "val_perplexity": validation,
            **{k: {steps} for k in ("test_loss", "test_perplexity", "test_tokens",
                                    "train_wall_s")}}


def server_answers(log: str) -> Counter:
    """HTTP status codes of the MLflow server's access-log lines (uvicorn's format)."""
    return Counter(int(code) for code in re.findall(r'HTTP/\d\.\d" (\d{3})', log))


def _database(server: str) -> tuple[str, sa.Engine, str]:
    admin = sa.create_engine(f"{server}/postgres", isolation_level="AUTOCOMMIT")
    name = f"cemlab_load_{uuid.uuid4().hex[:8]}"
    with admin.connect() as c:
        c.execute(sa.text(f'CREATE DATABASE "{name}"'))
    return f"{server}/{name}", admin, name


def run(trials: int, steps: int, server: str) -> int:
    url, admin, name = _database(server)
    home = Path(tempfile.mkdtemp(prefix="cemlab-load-"))
    env = {**os.environ, "CEMLAB_HOME": str(home), "CEMLAB_RAY_CPUS": str(trials),
           "CEMLAB_MLFLOW_BACKEND_URI": url, "CEMLAB_RAY_PORT": "0",
           "CEMLAB_RAY_DASHBOARD_PORT": "0", "CEMLAB_MLFLOW_PORT": "0",
           "VENV_BIN": str(Path(sys.executable).parent)}
    spec = {"name": "load", "data": {"source": "shakespeare", "vocab_size": 512},
            "sizes": ["nano"], "variants": {"llama": {}}, "learning_rates": [0.004],
            "seeds": list(range(trials)),
            "budget": {"tokens": steps * 16 * 64}, "training": TRAINING,
            "engine": {"zero_stage": 0},
            "resources": {"num_workers": 1, "cpus_per_worker": 1}}
    spec_path = home / "load.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    subprocess.run([str(ROOT / "infra/local/up.sh")], env=env, check=True, timeout=300)
    try:
        env.update(read_services_env(home / "services.env"))
        print(f"[load] {trials} concurrent nano trials of {steps} steps; Ray with {trials} "
              f"logical CPUs on {os.cpu_count()} cores; MLflow and the ledger on PostgreSQL "
              f"({name})", flush=True)
        started = time.perf_counter()
        job = subprocess.run(["ray", "job", "submit", "--working-dir", ".", "--", "python",
                              "-m", "orchestrator", "run", str(spec_path)], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=3600)
        wall = time.perf_counter() - started
        if job.returncode != 0:
            print(job.stdout[-3000:] + job.stderr[-3000:])
        os.environ.update({k: env[k] for k in env if k.startswith("MLFLOW_TRACKING")})
        limit = re.search(r"Ray Tune: \d+ trial\(s\) in \d+ worker group\(s\), up to (\d+) at once",
                          job.stdout)
        return report(env, home, trials, steps, wall, job.returncode,
                      int(limit.group(1)) if limit else None)
    finally:
        subprocess.run([str(ROOT / "infra/local/down.sh")], env=env, timeout=120)
        with admin.connect() as c:
            c.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def peak_running(rows) -> int:
    """The most trials that ran at once, from the ledger's start and finish times."""
    events = sorted([(r.started_at, 1) for r in rows if r.started_at]
                    + [(r.finished_at, -1) for r in rows if r.started_at and r.finished_at])
    running = peak = 0
    for _, change in events:
        running += change
        peak = max(peak, running)
    return peak


def report(env: dict, home: Path, trials: int, steps: int, wall: float, rc: int,
           limit: int | None) -> int:
    """Count points, compare ledger and MLflow, read the server's answers; print; exit code."""
    from mlflow import MlflowClient

    from orchestrator.records.ledger import Ledger, Status

    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    ledger = Ledger(env["CEMLAB_LEDGER_URL"], migrate=False)
    exp = ledger.experiment("load")
    rows = ledger.trials(exp.id) if exp else []
    expected = expected_points(steps, TRAINING["log_interval"], TRAINING["eval_interval"])
    lost = doubled = logged = disagree = 0
    for row in rows:
        run = client.get_run(row.mlflow_run_id) if row.mlflow_run_id else None
        if run is None or run.info.status != str(row.status):
            disagree += 1
        if row.status != Status.FINISHED:
            continue
        for key, want in expected.items():
            got = [m.step for m in client.get_metric_history(row.mlflow_run_id, key)]
            logged += len(got)
            lost += len(want - set(got))
            doubled += len(got) - len(set(got))
    answers = server_answers((home / "logs" / "mlflow.log").read_text(errors="replace"))
    errors = sum(n for code, n in answers.items() if code >= 500)
    finished = sum(r.status == Status.FINISHED for r in rows)
    table = [["trials finished", f"{finished} / {trials}"],
             ["trials at once: Tune's limit / peak in the ledger",
              f"{limit if limit is not None else '?'} / {peak_running(rows)}"],
             ["metric points expected (finished trials)",
              finished * sum(len(v) for v in expected.values())],
             ["metric points in MLflow", logged],
             ["points lost", lost], ["points logged twice", doubled],
             ["ledger and MLflow disagree (trials)", disagree + trials - len(rows)],
             ["MLflow requests", sum(answers.values())],
             ["MLflow 5xx answers", errors], ["MLflow 429 answers", answers.get(429, 0)],
             ["job exit code", rc], ["wall (submit to end)", f"{wall:.0f} s"]]
    print(tabulate(table, headers=["load test", "value"], colalign=("left", "right"),
                   disable_numparse=True))
    ok = (rc == 0 and finished == trials == len(rows) and lost == doubled == disagree == 0)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.local.load", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=16, help="concurrent nano trials")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per trial")
    parser.add_argument("--postgres", default=os.environ.get(
        "CEMLAB_TEST_POSTGRES", "postgresql+psycopg2://postgres@127.0.0.1:5432"),
        help="a PostgreSQL server URL (no database) where a scratch database may be created")
    args = parser.parse_args(argv)
    if args.trials < 1 or args.steps < 1:
        parser.error("--trials and --steps must be at least 1")
    return run(args.trials, args.steps, args.postgres)


if __name__ == "__main__":
    sys.exit(main())
