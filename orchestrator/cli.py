"""``python -m orchestrator {plan,run} SPEC``."""

from __future__ import annotations

import argparse
import logging
import sys

from orchestrator.spec import SpecError, load_spec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m orchestrator",
                                     description="CEM Lab experiments: plan and run specs.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_plan = sub.add_parser("plan", help="print the trials a spec would run; runs nothing")
    p_plan.add_argument("spec", help="path of the experiment YAML")
    p_run = sub.add_parser("run", help="train every trial of a spec (Ray Train + DeepSpeed)")
    p_run.add_argument("spec", help="path of the experiment YAML")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    try:
        spec = load_spec(args.spec)
    except SpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    if args.command == "plan":
        from orchestrator.plan import format_plan, plan_trials

        print(format_plan(spec, plan_trials(spec)))
        return 0
    from orchestrator.run import run_experiment  # imports ray and mlflow: only when running

    return 0 if run_experiment(spec) else 1


if __name__ == "__main__":
    sys.exit(main())
