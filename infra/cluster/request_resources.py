"""Have the Ray autoscaler start the nodes for N concurrent trials of a spec, before submitting it.

    python infra/cluster/request_resources.py experiments/paper/fig3a.yaml --trials 4 --wait 1800
    python infra/cluster/request_resources.py --release

Run it on the cluster (``ray exec CONFIG "cd ~/.cemlab-cluster/cemlab && python ..."`` or
``kubectl exec`` into the head pod). ``cemlab run`` sizes Ray Tune's concurrency
from the resources the cluster has when it starts: on a cluster whose GPU workers scale from
zero that is one trial at a time, and the autoscaler then never adds a second GPU node. This
asks for one bundle per trial (all of its workers' CPUs and GPUs, so that each lands on one
node, as Ray Train packs a trial's workers), waits until the cluster has them, and leaves the
request in place until ``--release`` (then idle nodes go after ``idle_timeout_minutes``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def bundles(spec_path: str | Path, trials: int) -> list[dict[str, float]]:
    """One resource bundle per concurrent trial of the spec at ``spec_path``: the CPUs (and
    GPUs) of all its Ray Train workers (``resources`` section of the spec)."""
    from orchestrator.planning.spec import load_spec

    r = load_spec(str(spec_path)).resources
    one = {"CPU": float(r.num_workers * r.cpus_per_worker)}
    if r.use_gpu:
        one["GPU"] = float(r.num_workers)
    return [dict(one) for _ in range(trials)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("spec", nargs="?", help="spec YAML (not with --release)")
    parser.add_argument("--trials", type=int, default=1, help="concurrent trials to provision")
    parser.add_argument("--wait", type=float, default=0,
                        help="seconds to wait for the resources to join (0: do not wait)")
    parser.add_argument("--release", action="store_true", help="withdraw the standing request")
    args = parser.parse_args(argv)
    if args.release == bool(args.spec):
        parser.error("give a SPEC, or --release")

    import ray
    from ray.autoscaler.sdk import request_resources

    ray.init(address="auto", log_to_driver=False)
    if args.release:
        request_resources(bundles=[])
        print("released the standing resource request")
        return 0
    wanted = bundles(args.spec, args.trials)
    request_resources(bundles=wanted)
    need = {k: sum(b.get(k, 0.0) for b in wanted) for k in ("CPU", "GPU")}
    print(f"requested {len(wanted)} x {wanted[0]} (total {need})", flush=True)
    deadline = time.monotonic() + args.wait
    while True:
        have = ray.cluster_resources()
        if all(have.get(k, 0.0) >= v for k, v in need.items()):
            print(f"cluster has {have.get('CPU', 0):g} CPU, {have.get('GPU', 0):g} GPU: ready")
            return 0
        if time.monotonic() >= deadline:
            print(f"cluster has {have.get('CPU', 0):g} CPU, {have.get('GPU', 0):g} GPU so far; "
                  "the request stands (watch `ray status`)")
            return 0 if args.wait == 0 else 1
        time.sleep(15)


if __name__ == "__main__":
    sys.exit(main())
