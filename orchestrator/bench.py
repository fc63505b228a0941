"""Benchmarks of the service that print numbers (speed goals live here, not in timed tests).

``python -m orchestrator.bench grid``: one grid of small trials, run twice, each time by
``cemlab run`` on a fresh local Ray instance, in one fresh ``CEMLAB_HOME`` (embedded ledger
and MLflow) whose corpus is prepared before either run: once with a Ray Train run per trial
(``resources.reuse_workers: false``), once with warm worker groups (a run per pack of
same-shaped trials). Both train every trial (``--no-cache``). For each it prints the job's
wall (submit to done), the share of the grid's slots' wall in train steps (the trials'
``time/train_s`` over slots x wall) and the overhead per trial (slots x wall minus train,
over the trials). Default: 12 ``nano`` trials, 3 LRs x 2 variants x 2 seeds, one worker of
one CPU each, at 10 % of nano's Chinchilla budget.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from orchestrator.table import format_table

ARMS = {"a Train run per trial": False, "warm worker groups": True}


def grid_spec(name: str, reuse: bool, args: argparse.Namespace) -> dict:
    """The benchmark's grid as a spec (``reuse``: ``resources.reuse_workers``)."""
    return {"name": name, "data": {"source": "shakespeare", "vocab_size": 512},
            "sizes": args.sizes, "variants": {v: {"attention": v, "mlp": v}
                                              for v in args.variants},
            "learning_rates": args.lrs, "seeds": list(range(args.seeds)),
            "budget": {"budget_scale": args.budget_scale},
            "training": {"batch_size": 16, "micro_batch_size": 16, "eval_interval": 100,
                         "eval_sequences": 32, "log_interval": 25},
            "resources": {"num_workers": 1, "cpus_per_worker": args.cpus_per_worker,
                          "reuse_workers": reuse}}


def run_arm(home: Path, spec: dict) -> dict:
    """Run ``spec`` in ``home`` on a fresh local Ray instance; its wall, slots and train
    seconds (from the trials' MLflow runs)."""
    from mlflow import MlflowClient

    from orchestrator.records import tracking
    from orchestrator.settings import Settings

    path = home / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["CEMLAB_HOME"] = str(home)
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "orchestrator", "run", "--no-cache", str(path)],
                          env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{spec['name']} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    slots = int(re.search(r"up to (\d+) at once", proc.stdout).group(1))
    trials = tracking.finished_trials(MlflowClient(Settings().tracking_uri), spec["name"])
    train = sum(t["metrics"]["time/train_s"] for t in trials)
    return {"trials": len(trials), "wall_s": wall, "slots": slots, "train_s": train}


def prepare_corpus(home: Path, spec: dict) -> None:
    """Tokenize the grid's corpus into ``home`` before either arm runs."""
    import ray

    from orchestrator.execution.run import prepare
    from orchestrator.planning.spec import parse_spec
    from orchestrator.settings import Settings

    prepare(parse_spec(spec), Settings())
    ray.shutdown()


def grid(args: argparse.Namespace) -> None:
    home = Path(args.home or tempfile.mkdtemp(prefix="cemlab-bench-"))
    os.environ["CEMLAB_HOME"] = str(home)
    specs = {arm: grid_spec(f"bench-grid-{'warm' if reuse else 'cold'}", reuse, args)
             for arm, reuse in ARMS.items()}
    print(f"[bench] CEMLAB_HOME {home}; preparing the corpus", flush=True)
    prepare_corpus(home, next(iter(specs.values())))
    rows = []
    for arm, spec in specs.items():
        print(f"[bench] {arm}: cemlab run {spec['name']}", flush=True)
        r = run_arm(home, spec)
        rows.append({"arm": arm, "trials": r["trials"], "slots": r["slots"],
                     "wall (s)": f"{r['wall_s']:.1f}",
                     "in train steps": f"{r['train_s'] / (r['slots'] * r['wall_s']):.0%}",
                     "overhead/trial (s)":
                         f"{(r['slots'] * r['wall_s'] - r['train_s']) / r['trials']:.1f}"})
    print(format_table(rows))
    cold, warm = (float(r["wall (s)"]) for r in rows)
    print(f"warm / cold wall: {warm / cold:.2f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m orchestrator.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("grid", help="a grid of small trials: a Train run per trial against "
                       "warm worker groups")
    p.add_argument("--sizes", nargs="+", default=["nano"])
    p.add_argument("--variants", nargs="+", default=["llama", "cem"])
    p.add_argument("--lrs", nargs="+", type=float, default=[0.002, 0.004, 0.008])
    p.add_argument("--seeds", type=int, default=2, help="seeds 0..N-1 (default 2)")
    p.add_argument("--budget-scale", type=float, default=0.1,
                   help="fraction of each size's Chinchilla budget (default 0.1)")
    p.add_argument("--cpus-per-worker", type=int, default=1)
    p.add_argument("--home", help="CEMLAB_HOME to run in (default: a new temporary one)")
    args = parser.parse_args(argv)
    grid(args)


if __name__ == "__main__":
    main()
