"""``cemlab {plan,run,train,join,status,results,seeds,report,export,import,models} ...``, the
command line of CEM Lab (also ``python -m orchestrator``)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from orchestrator.execution import join, local_trial
from orchestrator.planning.spec import SpecError, load_spec
from orchestrator.science.claims import CLAIM_SETS

REL_TOLERANCE = 1e-3  # `models eval` must reproduce the registered test perplexity this closely
MAX_TRIALS = 1000  # a larger grid runs only with --yes (a typo in a grid axis is days of GPU)


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (else argparse's one-line usage error)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cemlab",
                                     description="CEM Lab experiments: plan, run, analyse.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="print the grid of trials (a summary above 1,000) and "
                       "wall estimates; trains nothing")
    p.add_argument("spec", help="path of the experiment YAML")
    p.add_argument("--no-calibrate", action="store_true",
                   help="skip the measured calibration step (no wall-time estimate)")
    p = sub.add_parser("run", help="run every unfinished trial (Ray Tune + Train + DeepSpeed)")
    p.add_argument("spec", help="path of the experiment YAML")
    p.add_argument("--yes", action="store_true",
                   help=f"run a grid of more than {MAX_TRIALS:,} trials")
    p.add_argument("--no-cache", action="store_true",
                   help="train the trials that another experiment of the ledger has finished, "
                   "instead of copying them")
    p = sub.add_parser("train", help="train one trial in this process (a spec's row, or a "
                       "preset); no Ray, MLflow or ledger",
                       description=local_trial.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    local_trial.add_arguments(p)
    p = sub.add_parser("join", help="join this host to the Ray cluster of a head that `make up`"
                       " started (checks the token, storage and address first)",
                       description=join.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    join.add_arguments(p)
    p = sub.add_parser("status", help="progress of one experiment, or of all of them")
    p.add_argument("spec", nargs="?", help="path of the experiment YAML (default: all)")
    p = sub.add_parser("results", help="Akima-interpolated optimal learning rates of a spec")
    p.add_argument("spec", help="path of the experiment YAML")
    p = sub.add_parser("seeds", help="per arm: the learning rate chosen on the tuning seeds' "
                       "mean validation, the seed spread there, steps per trial, and how far "
                       "the validation set's noise can move the choice (from the ledger)")
    p.add_argument("spec", help="path of the experiment YAML")
    p = sub.add_parser("report", help="the paper's claims (or a study's): run what is missing, "
                       "then write REPORT.md with verdicts and figures")
    p.add_argument("directory", help="the claims' specs, e.g. experiments/paper/ (--claims "
                   "paper) or experiments/studies/ (--claims recursion)")
    p.add_argument("--claims", choices=sorted(CLAIM_SETS), default="paper",
                   help="which claims: the paper's (default) or the recursion study's (step "
                   "sizes, precision, tokens; recursion-options: Algorithm 1's other readings)")
    p.add_argument("--scale", choices=["cpu", "paper"], default="cpu",
                   help="cpu: the -cpu twins (default); paper: the paper-scale specs")
    p.add_argument("--out", default="docs/results", help="where REPORT.md and figures go")
    p.add_argument("--no-run", action="store_true",
                   help="report what the ledger has; train nothing")
    p.add_argument("--from", dest="bundles", action="append", metavar="BUNDLE",
                   help="report from this result bundle (`cemlab export`), or directory of "
                   "bundles (e.g. docs/results/data; repeatable), alone: no ledger, MLflow or "
                   "Ray; trains nothing")
    p = sub.add_parser("export", help="write the finished trials of experiments as a result "
                       "bundle (Parquet and a checksummed manifest), to commit or import "
                       "elsewhere")
    p.add_argument("experiments", nargs="+", metavar="EXPERIMENT",
                   help="an experiment's name in the ledger (`cemlab status` lists them)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="the bundle directory: created, or a bundle there replaced whole")
    p = sub.add_parser("import", help="verify a result bundle and record its trials FINISHED "
                       "in this ledger, where run skips them")
    p.add_argument("directory", help="the bundle directory (`cemlab export --out`), or a "
                   "directory of bundles (e.g. docs/results/data)")
    p.add_argument("--allow-code-drift", action="store_true",
                   help="import trials that another code computed (for reports: run would "
                   "train this code's own, their trial ids differ)")
    p = sub.add_parser("models", help="the model registry: list | show | eval | probe | "
                       "generate | export")
    models = p.add_subparsers(dest="action", required=True)
    models.add_parser("list", help="registered models: best version, perplexities, date")
    ref = "NAME[@ALIAS] or NAME/VERSION (alias best by default; @latest: the newest)"
    models.add_parser("show", help="a version's tags and aliases").add_argument("ref", help=ref)
    m = models.add_parser("eval", help="recompute a version's perplexity; stored on it")
    m.add_argument("ref", help=ref)
    m.add_argument("--split", choices=["test", "validation"], default="test",
                   help="the split to recompute perplexity on (default: test)")
    m.add_argument("--attn-steps", type=_positive_int, help="test-time recursion: run the CEM "
                   "attention for T steps (default: as trained)")
    m.add_argument("--mlp-steps", type=_positive_int, help="... the CEM MLP for T steps")
    m.add_argument("--step-size-scale", type=float, default=1.0, help="multiply every CEM "
                   "step size (T_train / T_eval keeps the total step; default 1)")
    m = models.add_parser("probe", help="how much of each attention layer reads content, "
                          "not position: KL from its position prior")
    m.add_argument("ref", help=ref)
    m.add_argument("--sequences", type=_positive_int, default=16,
                   help="validation sequences probed (default 16)")
    m = models.add_parser("generate", help="print a continuation sampled from a version")
    m.add_argument("ref", help=ref)
    m.add_argument("prompt", help="the text to continue")
    m.add_argument("--max-new-tokens", type=int, default=64, help="tokens to sample")
    m.add_argument("--temperature", type=float, default=0.8,
                   help="softmax temperature, 0 for greedy (default 0.8)")
    m.add_argument("--top-k", type=int, default=50,
                   help="sample among the k most likely tokens, 0 for all (default 50)")
    m.add_argument("--seed", type=int, default=0, help="sampling seed")
    m = models.add_parser("export", help="write a version as a Hugging Face directory")
    m.add_argument("ref", help=ref)
    m.add_argument("directory", help="the output directory (created)")
    m.add_argument("--format", choices=["hf"], default="hf",
                   help="hf: transformers' LlamaForCausalLM (Llama baselines only)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "join":
        from workloads.core.reach import ServiceError

        try:
            join.join(args)  # becomes the Ray node: returns only on an error
        except ServiceError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if args.command == "train":  # the train loop's own log lines, as a worker prints them
        try:
            local_trial.train(args)
        except SpecError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "models":
        return _models(args)
    if args.command == "status" and args.spec is None:
        return _status_all()
    if args.command == "report":
        return _report(args)
    if args.command == "export":
        return _export(args)
    if args.command == "import":
        return _import(args)
    try:
        spec = load_spec(args.spec)
    except SpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    if args.command == "plan":
        from orchestrator.planning.calibrate import estimate_wall_s
        from orchestrator.planning.plan import (
            SUMMARY_ABOVE,
            cells,
            concurrency,
            format_plan,
            format_summary,
            plan,
        )

        if spec.grid_size > SUMMARY_ABOVE:  # a row per cell, and one trial planned per cell
            grid = cells(spec)
            calibrated = [trial(spec.lr_grid[0], spec.seeds[0]) for trial in grid]
            wall = None if args.no_calibrate else estimate_wall_s(calibrated, spec.workload_impl)
            print(format_summary(spec, grid, wall, concurrency(spec)))
            return 0
        trials = plan(spec)
        slots = concurrency(spec)
        wall = None if args.no_calibrate else estimate_wall_s(trials, spec.workload_impl, slots)
        print(format_plan(spec, trials, wall, slots,
                          _finished_in_ledger({t.trial_id for t in trials})))
        return 0
    if args.command == "run":
        if spec.grid_size > MAX_TRIALS and not args.yes:
            print(f"error: {args.spec}: the grid has {spec.grid_size:,} trials, more than "
                  f"{MAX_TRIALS:,}: check its axes, or pass --yes to run them all",
                  file=sys.stderr)
            return 2
        from orchestrator.execution.run import (
            run_experiment,  # imports ray and mlflow: only when running
        )
        from workloads.core.reach import ServiceError

        try:
            return 0 if run_experiment(spec, Path(args.spec).read_text(),
                                       cache=not args.no_cache) else 1
        except ServiceError as e:  # raised before anything trains
            print(f"error: {e}", file=sys.stderr)
            return 2
    from orchestrator.records.ledger import Ledger
    from orchestrator.science.results import experiment_rows, format_optima, optima, short_metric
    from orchestrator.settings import Settings

    rows = experiment_rows(spec, Ledger(Settings().ledger_url))
    if args.command == "seeds":
        from orchestrator.science.results import format_seeds

        print(format_seeds(spec, rows))
        return 0
    if args.command == "status":
        from orchestrator.planning.plan import plan
        from orchestrator.science.results import format_status

        print(format_status(spec, rows, len(plan(spec))))
        _print_efficiency(spec.name, {r.trial_hash for r in rows}, time_split=True)
        return 0
    table = optima(spec, rows)
    if not table:
        print(f"no finished trial of '{spec.name}' yet (cemlab status "
              f"{args.spec})", file=sys.stderr)
        return 1
    print(f"Akima optima over log2(LR): the LR chosen on validation {short_metric(spec)}, "
          f"test reported there, experiment '{spec.name}'")
    print(format_optima(table, short_metric(spec)))
    _print_efficiency(spec.name, {r.trial_hash for r in rows}, time_split=False)
    return 0


def _finished_in_ledger(trial_ids: set[str]) -> set[str] | None:
    """Those of ``trial_ids`` that the ledger has FINISHED in any experiment, read without
    creating or migrating it (none without a ledger); None, said in one line, when it does not
    answer within 5 s."""
    from orchestrator.records.ledger import Ledger
    from orchestrator.settings import Settings

    url = Settings().existing_ledger_url()
    if url is None:
        return set()
    try:
        return Ledger(url, migrate=False, retry_deadline_s=5).finished_hashes(trial_ids)
    except Exception as e:  # planning needs no ledger
        print(f"cached: unknown, the ledger did not answer ({str(e).splitlines()[0]})",
              file=sys.stderr)
        return None


def _print_efficiency(experiment: str, trial_ids: set[str], time_split: bool) -> None:
    """The MFU and peak memory per variant and size of the experiment's trials ``trial_ids``
    (with ``time_split``, first their time split) from MLflow, or one line on why there are
    none."""
    from mlflow import MlflowClient

    from orchestrator.records.tracking import finished_trials
    from orchestrator.science.results import format_efficiency, format_time_split
    from orchestrator.settings import Settings
    from workloads.core.reach import check_tracking

    uri = Settings().tracking_uri
    try:
        check_tracking(uri, timeout_s=5)
    except Exception as e:  # status and results still answer from the ledger
        print(f"time split, MFU and memory: MLflow unavailable ({str(e).splitlines()[0]})")
        return
    trials = finished_trials(MlflowClient(uri), experiment, trial_ids)
    if time_split:
        print(format_time_split(trials))
    print(format_efficiency(trials))


def _status_all() -> int:
    from orchestrator.records.ledger import Ledger
    from orchestrator.science.results import status_counts
    from orchestrator.settings import Settings
    from orchestrator.table import format_table

    ledger = Ledger(Settings().ledger_url)
    rows = []
    for e in ledger.experiments():
        trials = ledger.trials(e.id)
        rows.append({"experiment": e.name, "workload": e.workload, "trials": len(trials),
                     **{s.lower(): n for s, n in status_counts(trials).items()},
                     "updated": e.updated_at.strftime("%Y-%m-%d %H:%M:%S")})
    print(format_table(rows) if rows else "no experiments in the ledger yet")
    return 0


def _report(args: argparse.Namespace) -> int:
    from orchestrator.records.ledger import Ledger
    from orchestrator.science import report
    from orchestrator.settings import Settings

    try:
        claim_set = CLAIM_SETS[args.claims]
        pairs = report.claims_of(Path(args.directory), args.scale, claim_set)
        specs = {p: load_spec(p) for p in sorted({p for _, p in pairs})}
    except (FileNotFoundError, SpecError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.bundles:
        return _report_from_bundles(args, pairs, specs, claim_set)
    settings = Settings()
    ledger = Ledger(settings.ledger_url)
    missing = {p: report.missing_trials(spec, ledger) for p, spec in specs.items()}
    todo = [p for p, trials in missing.items() if trials]
    print(f"claims report: {len(pairs)} claims over {len(specs)} specs; "
          f"{sum(map(len, missing.values()))} trial(s) missing in {len(todo)} spec(s)",
          flush=True)
    if todo and not args.no_run:
        from orchestrator.execution.run import run_experiment
        from orchestrator.planning.calibrate import estimate_wall_s
        from orchestrator.planning.plan import concurrency
        from workloads.core.reach import ServiceError

        wall = sum(sum(estimate_wall_s(missing[p], specs[p].workload_impl,
                                       concurrency(specs[p])).values()) / concurrency(specs[p])
                   for p in todo)
        print(f"running them now: about {wall / 3600:.1f} h on this machine "
              f"(calibrated, {', '.join(p.stem for p in todo)})", flush=True)
        for path in todo:
            try:
                run_experiment(specs[path], path.read_text())
            except ServiceError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
    from mlflow import MlflowClient

    client = MlflowClient(settings.tracking_uri)  # asked only by test-time arms
    return _write_claims(args, pairs, specs, ledger,
                         lambda run_id: client.get_run(run_id).data.metrics, claim_set)


def _write_claims(args: argparse.Namespace, pairs: list, specs: dict, ledger,
                  run_metrics, claim_set) -> int:
    """Evaluate every claim of ``pairs`` on ``ledger`` (test-time arms reading
    ``run_metrics``), print the verdicts and write the report to ``args.out``."""
    from orchestrator.science import report

    results = [report.evaluate(claim, specs[path], ledger, run_metrics)
               for claim, path in pairs]
    print(report.verdict_table(results))
    written = report.write_report(results, Path(args.out), args.scale, args.directory,
                                  claim_set)
    print(f"wrote {written} and {sum(bool(r.effects) for r in results)} figure(s)")
    return 0


def _report_from_bundles(args: argparse.Namespace, pairs: list, specs: dict,
                         claim_set) -> int:
    """The claims report of ``args.bundles`` alone: their trials recorded in a temporary
    SQLite ledger (with their runs' ids), the test-time arms reading the runs' final metrics
    from the bundles; no ledger, MLflow or Ray of this machine is used."""
    import tempfile

    from orchestrator.records import bundles
    from orchestrator.records.ledger import Ledger
    from orchestrator.science import report

    with tempfile.TemporaryDirectory(prefix="cemlab-report-") as tmp:
        ledger = Ledger(f"sqlite:///{Path(tmp) / 'ledger.db'}")
        metrics: dict[str, dict[str, float]] = {}
        found = _bundle_dirs(args.bundles)
        for directory in found:
            try:
                bundle = bundles.check_bundle(directory, allow_code_drift=True)
            except bundles.BundleError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
            drift = bundles.code_drift(bundle)
            if drift:
                print(f"note: {directory}: {drift}")
            bundles.record(bundle, ledger, keep_run_ids=True)
            metrics.update(bundle.run_metrics())
        missing = sum(len(report.missing_trials(spec, ledger)) for spec in specs.values())
        print(f"claims report from {len(found)} bundle(s): {len(pairs)} claims over "
              f"{len(specs)} specs; {missing} trial(s) not in the bundles", flush=True)
        return _write_claims(args, pairs, specs, ledger,
                             lambda run_id: metrics.get(run_id, {}), claim_set)


def _export(args: argparse.Namespace) -> int:
    """``cemlab export``: the bundle of ``args.experiments`` in ``args.out``, read from the
    ledger (never created or migrated here) and, where it answers, MLflow."""
    from orchestrator.records import bundles
    from orchestrator.records.ledger import Ledger
    from orchestrator.settings import Settings

    settings = Settings()
    url = settings.existing_ledger_url()
    if url is None:
        print(f"error: no ledger at {settings.cemlab_home / 'mlflow.db'} (CEMLAB_HOME) and "
              "none named by CEMLAB_LEDGER_URL or MLFLOW_TRACKING_URI", file=sys.stderr)
        return 2
    try:
        ledger = Ledger(url, migrate=False)
        client = bundles.tracking_client(settings.existing_tracking_uri())
        manifest = bundles.export_bundle(ledger, args.experiments, Path(args.out), client,
                                         settings.storage)
    except (bundles.BundleError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    size = sum(f.bytes for f in manifest.files.values())
    print(f"wrote {args.out}: {manifest.trials} finished trial(s) of "
          f"{len(manifest.experiments)} experiment(s) ({', '.join(manifest.experiments)}), "
          f"{size:,} bytes, code {manifest.code}")
    return 0


def _bundle_dirs(paths: list[str]) -> list[Path]:
    """The bundles at ``paths``, each a bundle or a directory of bundles
    (``bundles.find_bundles``); a path that holds none stays itself, for ``check_bundle`` to
    say what it lacks."""
    from orchestrator.records import bundles

    return [d for path in paths for d in bundles.find_bundles(Path(path)) or [Path(path)]]


def _import(args: argparse.Namespace) -> int:
    """``cemlab import``: verify every bundle in ``args.directory`` (a bundle, or a directory
    of bundles) before opening the ledger (when one does not verify, nothing is written), then
    record their trials there."""
    from orchestrator.records import bundles
    from orchestrator.records.ledger import Ledger
    from orchestrator.settings import Settings

    found = _bundle_dirs([args.directory])
    try:
        checked = [bundles.check_bundle(d, args.allow_code_drift) for d in found]
    except bundles.BundleError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ledger = Ledger(Settings().ledger_url)
    for directory, bundle in zip(found, checked):
        done = bundles.record(bundle, ledger)
        held = f"; {done.held} unfinished and held by a live submission, left to it" \
            if done.held else ""
        print(f"imported {done.imported} trial(s) of {len(bundle.experiments)} experiment(s) "
              f"from {directory}; {done.present} already there{held}")
    return 0


def _models(args: argparse.Namespace) -> int:

    from mlflow import MlflowClient

    from orchestrator.records import model_registry as registry
    from orchestrator.settings import Settings
    from orchestrator.table import format_table

    settings = Settings()
    client = MlflowClient(settings.tracking_uri)
    if args.action == "list":
        rows = registry.list_rows(client)
        print(format_table(rows) if rows else "no registered cemlab models yet")
        return 0
    try:
        version = registry.resolve(client, args.ref)
        if args.action == "show":
            print(f"{version.name} version {version.version} (run {version.run_id})")
            aliases = ", ".join(version.aliases) or "-"
            print(f"aliases: {aliases}\nsource: {version.source}")
            for k, v in sorted(version.tags.items()):
                print(f"  {k}: {v}")
            return 0
        if args.action == "generate":
            return _generate(version, settings.tracking_uri, args)
        if args.action == "probe":
            rows = registry.probe_version(version, settings.tracking_uri, settings.data_dir,
                                          sequences=args.sequences)
            print(f"{version.name} version {version.version}: attention against its position "
                  "prior (nats; KL 0 = position only)")
            rows = [{**r, "entropy": f"{r['entropy']:.3f}",
                     "prior_entropy": f"{r['prior_entropy']:.3f}",
                     "kl_to_prior": f"{r['kl_to_prior']:.4f}"} for r in rows]
            print(format_table(rows) if rows else "no attention with a position bias (RoPE "
                  "Llama): nothing to probe")
            return 0
        if args.action == "export":
            out = registry.export_version(version, settings.tracking_uri, args.directory)
            print(f"wrote {out}: transformers.LlamaForCausalLM.from_pretrained({str(out)!r})")
            return 0
        recursion = {k: v for k, v in (("attn_steps", args.attn_steps),
                                         ("mlp_steps", args.mlp_steps),
                                         ("step_size_scale", args.step_size_scale))
                     if v is not None and (k != "step_size_scale" or v != 1.0)}
        recomputed, registered = registry.evaluate_version(
            client, version, settings.tracking_uri, settings.data_dir, args.split,
            recursion=recursion)
    except (LookupError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if recursion:
        print(f"{version.name} version {version.version}: {args.split} perplexity "
              f"{recomputed:.4f} at test-time recursion {registry.recursion_tag(recursion)} "
              "(stored on the version)")
        return 0
    line = (f"{version.name} version {version.version}: {args.split} perplexity "
            f"{recomputed:.4f} recomputed")
    if registered is None:
        print(f"{line} (stored on the version; none was registered)")
        return 0
    rel = abs(recomputed - registered) / registered
    ok = rel <= REL_TOLERANCE
    print(f"{line}, {registered:.4f} registered, relative difference {rel:.2e} "
          f"({'within' if ok else 'OUTSIDE'} {REL_TOLERANCE:g})")
    return 0 if ok else 1


def _generate(version, tracking_uri: str, args: argparse.Namespace) -> int:
    """Print ``args.prompt`` and a continuation sampled from the pyfunc of ``version``.

    Raises:
        LookupError: a version with no safetensors package (never unpickled).
    """
    import tempfile

    import mlflow.pyfunc
    import pandas as pd

    from orchestrator.records.model_registry import download_model

    with tempfile.TemporaryDirectory() as tmp:
        model = mlflow.pyfunc.load_model(str(download_model(version, tracking_uri, tmp)))
    out = model.predict(pd.DataFrame({"text": [args.prompt]}), params={
        "task": "generate", "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature, "top_k": args.top_k, "seed": args.seed})
    print(args.prompt + out["continuation"][0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
