"""Result bundles: finished trials exported to Parquet with a checksummed manifest, verified and
imported into another ledger, where ``run`` skips them (cache hits) and reports read them.
Real SQLite ledgers and MLflow stores, the toy workload, no Ray."""

import hashlib
import json
import logging
import math
import shutil
import statistics

import pandas as pd
import pytest
from mlflow import MlflowClient

from orchestrator.cli import main
from orchestrator.execution.run import claim, model_runs, open_books
from orchestrator.planning.plan import plan
from orchestrator.planning.spec import load_spec, parse_spec
from orchestrator.records import bundles
from orchestrator.records.ledger import Ledger, Status
from orchestrator.science.claims import Claim, Comparison
from orchestrator.science.report import evaluate, missing_trials
from orchestrator.settings import Settings
from tests.conftest import free_port
from tests.orchestrator.test_report import LRS, PAPER, _seed_ledger, _test_time_study
from tests.orchestrator.test_trial_cache import (  # noqa: F401 (fixture)
    PREPARED,
    _spec,
    _train,
    settings,
)
from tests.orchestrator.test_workload_interface import toy  # noqa: F401 (fixture)
from workloads.core.provenance import code_fingerprint


@pytest.fixture(scope="session")
def empty_mlflow_store(tmp_path_factory):
    """An MLflow SQLite store with its tables made (seconds of migrations), copied per test."""
    path = tmp_path_factory.mktemp("mlflow-store") / "mlflow.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def tracked(settings, empty_mlflow_store, tmp_path):  # noqa: F811
    """``settings`` (CEMLAB_HOME and MLflow's store under ``tmp_path``), its store made."""
    shutil.copy(empty_mlflow_store, tmp_path / "mlflow.db")
    return settings


COLUMNS = ("trial_hash", "dataset", "variant", "size", "lr", "seed", "lr_round", "metric",
           "val_metric", "started_at", "finished_at", "checkpoint_path")


def _studies(where: Settings, tmp_path):
    """Experiments toy-a (two trials trained, one with a val_mse history and a checkpoint on
    disk) and toy-b (one trained, one settled from toy-a's through the trial cache), as
    ``run`` records them. Returns ``(ledger, client, specs)``."""
    spec_a, spec_b = _spec("toy-a", [0.01, 0.05]), _spec("toy-b", [0.05, 0.1])
    checkpoint = tmp_path / "ckpt" / "checkpoint_x_80_1"
    checkpoint.mkdir(parents=True)
    (checkpoint / "model.pt").write_bytes(b"weights" * 100)
    (checkpoint / "manifest-rank0.json").write_text("{}")
    for spec, values in ((spec_a, [(0.5, 0.6), (0.4, 0.45)]), (spec_b, [(0.3, 0.35)])):
        books = open_books(spec, f"name: {spec.name}\n", where)
        tasks, _ = claim(spec, plan(spec), PREPARED, books, f"owner-{spec.name}")
        for task, (val, test) in zip(tasks, values):
            for step, v in ((40, 2 * val), (80, val)):
                books.client.log_metric(task.job.run_id, "val_mse", v, step=step)
            _train(books, task, val, test, losses=[3.0, 1.0])
        if spec is spec_a:
            books.ledger.update_trial(tasks[0].row_id, checkpoint_path=str(checkpoint))
    return books.ledger, books.client, (spec_a, spec_b)


def _rows(ledger: Ledger) -> dict[tuple[str, str], dict]:
    """Every trial row by (experiment name, trial id): its coordinates, metrics and times."""
    names = {e.id: e.name for e in ledger.experiments()}
    return {(names[e], r.trial_hash): {"status": r.status, **{c: getattr(r, c) for c in COLUMNS},
                                       "source": r.source_trial_id and names[
                                           ledger.trial_by_id(r.source_trial_id).experiment_id]}
            for e in names for r in ledger.trials(e)}


def test_a_bundle_round_trips_into_a_fresh_ledger_where_run_finds_every_trial_finished(
        toy, tracked, tmp_path, monkeypatch):  # noqa: F811
    ledger, client, (spec_a, spec_b) = _studies(tracked, tmp_path)
    out = tmp_path / "bundle"
    manifest = bundles.export_bundle(ledger, ["toy-b", "toy-a"], out, client, tracked.storage)
    assert manifest.experiments == ["toy-a", "toy-b"] and manifest.trials == 4
    assert manifest.code == code_fingerprint() and manifest.format == bundles.FORMAT
    assert sorted(p.name for p in out.iterdir()) == [
        "experiments.parquet", "manifest.json", "trials.parquet"]
    for name, entry in manifest.files.items():  # checked independently of the code under test
        data = (out / name).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (entry.bytes, entry.sha256)

    trials = pd.read_parquet(out / "trials.parquet")
    assert list(zip(trials.experiment, trials.trial_hash)) == sorted(_rows(ledger))
    assert set(trials.code) == {code_fingerprint()}  # the runs' cemlab.code tag
    assert trials.source_experiment.tolist().count("toy-a") == 1  # toy-b's cached trial
    trained = trials[trials.checkpoint_path.notna() & trials.checkpoint_path.str.contains("ckpt/c")]
    (digest,) = trained.checkpoint_sha256  # sha256 over "<path>\0<sha256 of file>\n", by path
    files = sorted((tmp_path / "ckpt" / "checkpoint_x_80_1").iterdir())
    assert digest == hashlib.sha256(b"".join(
        f"{f.name}\0{hashlib.sha256(f.read_bytes()).hexdigest()}\n".encode()
        for f in files)).hexdigest()
    assert trials.checkpoint_sha256.isna().sum() == 3  # "/ckpt/a" does not exist here
    first = trials[trials.experiment == "toy-a"].iloc[0]
    assert json.loads(first.params)["toy.dim"] == "3"
    assert json.loads(first.metrics)["loss"] == 1.0
    history = json.loads(first.history)
    assert set(history) == {"val_mse"} and list(history["val_mse"]) == ["40", "80"]
    assert first.host and first.python_version and first.mlflow_version
    experiments = pd.read_parquet(out / "experiments.parquet")
    assert experiments.spec_sha256.tolist() == [
        hashlib.sha256(t.encode()).hexdigest() for t in experiments.spec_yaml]

    fresh = Ledger(f"sqlite:///{tmp_path / 'elsewhere.db'}")
    done = bundles.import_bundle(out, fresh)
    assert (done.imported, done.present, done.held) == (4, 0, 0)
    assert _rows(fresh) == _rows(ledger)  # the same rows, metrics, times and cache sources
    assert all(r.mlflow_run_id is None for e in fresh.experiments() for r in fresh.trials(e.id))
    again = bundles.import_bundle(out, fresh)  # idempotent
    assert (again.imported, again.present) == (0, 4) and _rows(fresh) == _rows(ledger)
    # Exported again from there, where MLflow has none of their runs: the same rows, every
    # field the first export had (run ids, params, metrics, history, digest, host) kept.
    bundles.export_bundle(fresh, ["toy-a", "toy-b"], tmp_path / "again", None, tracked.storage)
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "again" / "trials.parquet"), trials)

    # `run` on the same specs, against the new ledger and an empty MLflow: nothing to train
    monkeypatch.setenv("CEMLAB_LEDGER_URL", f"sqlite:///{tmp_path / 'elsewhere.db'}")
    for spec in (spec_a, spec_b):
        assert missing_trials(spec, fresh) == []
        assert fresh.finished_hashes({t.trial_id for t in plan(spec)}) == {
            t.trial_id for t in plan(spec)}  # what `plan` marks cached
        books = open_books(spec, "", Settings())
        assert claim(spec, plan(spec), PREPARED, books, "owner-elsewhere") == ([], [])


def test_an_imported_trial_is_a_cache_source_for_another_experiment(
        toy, tracked, tmp_path, monkeypatch):  # noqa: F811
    ledger, client, (spec_a, _) = _studies(tracked, tmp_path)
    bundles.export_bundle(ledger, ["toy-a"], tmp_path / "a", client)
    monkeypatch.setenv("CEMLAB_LEDGER_URL", f"sqlite:///{tmp_path / 'elsewhere.db'}")
    fresh = Ledger(Settings().ledger_url)
    bundles.import_bundle(tmp_path / "a", fresh)
    spec_c = _spec("toy-c", [0.05, 0.2])  # shares LR 0.05 with toy-a
    books = open_books(spec_c, "", Settings())
    tasks, _ = claim(spec_c, plan(spec_c), PREPARED, books, "owner-c")
    assert [t.job.trial.lr for t in tasks] == [0.2]  # 0.05 copied from the import
    copy = next(r for r in fresh.trials(books.experiment_row_id) if r.lr == 0.05)
    assert (copy.status, copy.mlflow_run_id, copy.val_metric) == (Status.FINISHED, None, 0.4)
    assert model_runs([copy], fresh) == {}  # no run here, so no model to register
    # Its bundle row carries the source's run: the run id where it trained, its metrics.
    bundles.export_bundle(fresh, ["toy-a", "toy-c"], tmp_path / "c")
    rows = pd.read_parquet(tmp_path / "c" / "trials.parquet")
    source, copied = (rows[(rows.experiment == name) & (rows.lr == 0.05)].iloc[0]
                      for name in ("toy-a", "toy-c"))
    assert copied.source_experiment == "toy-a" and copied.mlflow_run_id is not None
    assert (copied.mlflow_run_id, copied.metrics) == (source.mlflow_run_id, source.metrics)
    assert json.loads(copied.metrics)["loss"] == 1.0


def test_re_exporting_gives_the_same_bytes_and_replaces_the_bundle_whole(
        toy, tracked, tmp_path, monkeypatch):  # noqa: F811
    ledger, client, _ = _studies(tracked, tmp_path)
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1767225600")
    out = tmp_path / "bundle"
    bundles.export_bundle(ledger, ["toy-a", "toy-b"], out, client, tracked.storage)
    first = {p.name: p.read_bytes() for p in out.iterdir()}
    assert json.loads(first["manifest.json"])["created_at"] == "2026-01-01T00:00:00+00:00"
    bundles.export_bundle(ledger, ["toy-a", "toy-b"], out, client, tracked.storage)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == first
    bundles.export_bundle(ledger, ["toy-a"], out, client, tracked.storage)
    assert json.loads((out / "manifest.json").read_text())["trials"] == 2
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".bundle")) == []
    # a directory that is not a bundle is never replaced
    other = tmp_path / "notes"
    other.mkdir()
    (other / "README.md").write_text("mine")
    with pytest.raises(bundles.BundleError, match=r"notes: not a bundle directory \(holds "
                                                  r"README.md\)"):
        bundles.export_bundle(ledger, ["toy-a"], other, client)
    assert [p.name for p in other.iterdir()] == ["README.md"]
    with pytest.raises(bundles.BundleError, match=r"no experiment 'toy-z' in the ledger .* "
                                                  r"\(known: toy-a, toy-b\)"):
        bundles.export_bundle(ledger, ["toy-z"], tmp_path / "z", client)
    assert not (tmp_path / "z").exists()


def _exported(tmp_path, offsets=None) -> tuple[Ledger, object]:
    """A ledger of finished trials of spec ``claims`` (``_seed_ledger``) and its bundle
    (exported without MLflow) at ``tmp_path / "bundle"``."""
    spec = parse_spec({"name": "claims", "sizes": ["nano"], "seeds": [0, 1, 2],
                       "variants": {"llama": {}, "cem-attn": {"attention": "cem"}},
                       "learning_rates": LRS})
    ledger = _seed_ledger(tmp_path, spec, offsets or {"llama": [0.0, 0.1, -0.05],
                                                      "cem-attn": [0.03, 0.13, -0.02]})
    bundles.export_bundle(ledger, ["claims"], tmp_path / "bundle")
    return ledger, spec


def test_a_bundle_is_found_at_its_path_or_one_directory_below_it(tmp_path):
    """``find_bundles`` takes a bundle, or a directory of bundles (not deeper), and finds
    nothing where no manifest is."""
    _exported(tmp_path)
    bundle = tmp_path / "bundle"
    assert bundles.find_bundles(bundle) == [bundle]
    shelf = tmp_path / "shelf"
    for name in ("b", "a"):
        shutil.copytree(bundle, shelf / name)
    (shelf / "notes").mkdir()
    shutil.copytree(bundle, shelf / "notes" / "deeper")
    (shelf / "README.md").write_text("not a bundle\n")
    assert bundles.find_bundles(shelf) == [shelf / "a", shelf / "b"]
    assert bundles.find_bundles(shelf / "notes" / "deeper" / "trials.parquet") == []
    assert bundles.find_bundles(tmp_path / "absent") == []
    assert bundles.find_bundles(shelf / "notes") == [shelf / "notes" / "deeper"]


def test_a_bundle_whose_file_changed_or_is_missing_is_refused_and_nothing_is_written(
        tmp_path, monkeypatch, capsys):
    _exported(tmp_path)
    bundle = tmp_path / "bundle"
    target = tmp_path / "target.db"
    monkeypatch.setenv("CEMLAB_LEDGER_URL", f"sqlite:///{target}")
    trials = bundle / "trials.parquet"
    data = bytearray(trials.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of one byte
    trials.write_bytes(bytes(data))
    assert main(["import", str(bundle)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: {trials}: checksum mismatch")
    assert not target.exists()  # no ledger was even created
    trials.unlink()
    assert main(["import", str(bundle)]) == 2
    assert capsys.readouterr().err.strip() == (f"error: {trials}: missing (listed in "
                                               "manifest.json)")
    (bundle / "manifest.json").unlink()
    assert main(["import", str(bundle)]) == 2
    assert capsys.readouterr().err.strip() == (f"error: {bundle / 'manifest.json'}: missing "
                                               "(not a bundle)")
    assert not target.exists()


def test_import_prints_what_it_did_and_leaves_finished_and_held_trials_as_they_are(
        tmp_path, monkeypatch, capsys):
    source, _ = _exported(tmp_path)
    target = Ledger(f"sqlite:///{tmp_path / 'target.db'}")
    exp = target.ensure_experiment("claims", "language_model", "local spec")
    finished, held, failed = (
        target.ensure_trial(exp.id, r.trial_hash, dataset=r.dataset, variant=r.variant,
                            size=r.size, lr=r.lr, seed=r.seed) for r in source.trials(1)[:3])
    target.update_trial(finished.id, status=Status.FINISHED, metric=1.0, val_metric=2.0)
    assert target.acquire(held.id, "training-here", lease_s=600).acquired
    target.update_trial(held.id, status=Status.RUNNING)
    target.update_trial(failed.id, status=Status.FAILED, error="diverged")
    monkeypatch.setenv("CEMLAB_LEDGER_URL", target.engine.url.render_as_string())
    assert main(["import", str(tmp_path / "bundle")]) == 0
    n = len(source.trials(1))
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        f"imported {n - 2} trial(s) of 1 experiment(s) from {tmp_path / 'bundle'}; "
        "1 already there; 1 unfinished and held by a live submission, left to it")
    kept = target.trial_by_id(finished.id)
    assert (kept.metric, kept.val_metric) == (1.0, 2.0)  # left as it was
    running = target.trial_by_id(held.id)
    assert (running.status, running.lease_owner) == (Status.RUNNING, "training-here")
    settled = target.trial_by_id(failed.id)
    assert (settled.status, settled.error, settled.metric) == (
        Status.FINISHED, None, source.trials(1)[2].metric)
    target.update_trial(held.id, owner="training-here", status=Status.FINISHED, metric=3.0)
    assert target.experiment("claims").spec_yaml == "local spec"
    assert main(["import", str(tmp_path / "bundle")]) == 0
    assert capsys.readouterr().out.strip().endswith(f"imported 0 trial(s) of 1 experiment(s) "
                                                    f"from {tmp_path / 'bundle'}; {n} already "
                                                    "there")  # the held one finished here
    assert len(target.trials(exp.id)) == n


def test_trials_of_another_code_are_refused_unless_drift_is_allowed(
        toy, tracked, tmp_path, monkeypatch, capsys):  # noqa: F811
    ledger, client, (spec_a, _) = _studies(tracked, tmp_path)
    (row, _) = ledger.trials(ledger.experiment("toy-a").id)
    client.set_tag(row.mlflow_run_id, "cemlab.code", "feedfacefeedface")  # trained elsewhere
    bundle = tmp_path / "bundle"
    bundles.export_bundle(ledger, ["toy-a"], bundle, client)
    target = tmp_path / "target.db"
    monkeypatch.setenv("CEMLAB_LEDGER_URL", f"sqlite:///{target}")
    capsys.readouterr()
    assert main(["import", str(bundle)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {bundle}: 1 of 2 trial(s) were computed by code feedfacefeedface, this code "
        f"is {code_fingerprint()}: run would not find them (their trial ids differ); pass "
        "--allow-code-drift to import them anyway"]
    assert not target.exists()
    assert main(["import", str(bundle), "--allow-code-drift"]) == 0
    assert "imported 2 trial(s)" in capsys.readouterr().out
    assert missing_trials(spec_a, Ledger(f"sqlite:///{target}")) == []  # a report reads them


def test_export_and_import_on_the_command_line(toy, tracked, tmp_path, monkeypatch, capsys):  # noqa: F811
    _studies(tracked, tmp_path)
    capsys.readouterr()
    out = tmp_path / "results" / "toy"
    assert main(["export", "toy-a", "toy-b", "--out", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    size = sum(f["bytes"] for f in manifest["files"].values())
    assert capsys.readouterr().out.strip() == (
        f"wrote {out}: 4 finished trial(s) of 2 experiment(s) (toy-a, toy-b), {size:,} bytes, "
        f"code {code_fingerprint()}")
    assert pd.read_parquet(out / "trials.parquet").params.notna().all()  # read from MLflow
    assert main(["export", "toy-q", "--out", str(tmp_path / "q")]) == 2
    assert capsys.readouterr().err.startswith("error: no experiment 'toy-q' in the ledger")
    monkeypatch.setenv("CEMLAB_LEDGER_URL", f"sqlite:///{tmp_path / 'elsewhere.db'}")
    assert main(["import", str(out)]) == 0
    assert capsys.readouterr().out.strip().endswith("imported 4 trial(s) of 2 experiment(s) "
                                                    f"from {out}; 0 already there")
    # a directory of bundles (as docs/results/data): each bundle in it, by name
    assert main(["export", "toy-a", "--out", str(out.parent / "a-only")]) == 0
    monkeypatch.setenv("CEMLAB_LEDGER_URL", f"sqlite:///{tmp_path / 'third.db'}")
    capsys.readouterr()
    assert main(["import", str(out.parent)]) == 0
    assert capsys.readouterr().out.strip().splitlines() == [
        f"imported 2 trial(s) of 1 experiment(s) from {out.parent / 'a-only'}; 0 already there",
        f"imported 2 trial(s) of 2 experiment(s) from {out}; 2 already there"]
    assert main(["import", str(tmp_path / "q")]) == 2  # holds no bundle
    assert capsys.readouterr().err.strip().startswith(f"error: {tmp_path / 'q'}")


def test_without_mlflow_the_bundle_holds_the_ledgers_fields_and_says_so(
        tmp_path, monkeypatch, caplog):
    ledger, _ = _exported(tmp_path)
    monkeypatch.setenv("CEMLAB_LEDGER_URL", ledger.engine.url.render_as_string())
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")  # no server
    out = tmp_path / "no-mlflow"
    with caplog.at_level(logging.WARNING, logger="orchestrator.records.bundles"):
        assert main(["export", "claims", "--out", str(out)]) == 0
    assert "exporting the ledger's fields only" in caplog.text
    trials = pd.read_parquet(out / "trials.parquet")
    assert len(trials) == 18 and set(trials.code) == {code_fingerprint()}
    assert trials[["params", "metrics", "history", "mlflow_run_id"]].isna().all().all()
    assert sorted(zip(trials.trial_hash, trials.metric)) == sorted(
        (r.trial_hash, r.metric) for r in ledger.trials(1))


def test_a_report_from_bundles_alone_equals_the_report_from_the_ledger_and_mlflow(
        tmp_path, empty_mlflow_store):
    """Test-time arms read the runs' final metrics: from MLflow on the ledger, from the bundle's
    JSON without it."""
    shutil.copy(empty_mlflow_store, tmp_path / "mlflow.db")
    spec, ledger, client = _test_time_study(tmp_path)
    bundles.export_bundle(ledger, ["claims"], tmp_path / "bundle", client)
    test_time = Claim("j", "More steps at test time", "quote", "Sec. 0", "fig0",
                      (Comparison("cem@T4_scaled", "cem@T2_kept"),))
    here = evaluate(test_time, spec, ledger, lambda run_id: client.get_run(run_id).data.metrics)

    bundle = bundles.check_bundle(tmp_path / "bundle")
    alone = Ledger(f"sqlite:///{tmp_path / 'alone.db'}")
    bundles.record(bundle, alone, keep_run_ids=True)
    metrics = bundle.run_metrics()
    there = evaluate(test_time, spec, alone, lambda run_id: metrics.get(run_id, {}))
    assert there.effects == here.effects and there.arms == here.arms
    assert math.isclose(there.effects[0].estimate, math.log(0.97), rel_tol=1e-9)


@pytest.mark.slow
def test_a_bundle_of_300_trials_is_small(tmp_path):
    spec = parse_spec({"name": "claims", "sizes": ["nano"], "seeds": list(range(10)),
                       "variants": {f"v{i}": {} for i in range(6)},
                       "learning_rates": [0.0005 * 2 ** (i / 2) for i in range(5)]})
    ledger = _seed_ledger(tmp_path, spec, {f"v{i}": [0.01 * i] * 10 for i in range(6)})
    manifest = bundles.export_bundle(ledger, ["claims"], tmp_path / "bundle")
    assert manifest.trials == 300
    assert sum(f.bytes for f in manifest.files.values()) < 64 * 1024


def test_report_from_a_bundle_needs_no_ledger_mlflow_or_ray(tmp_path, monkeypatch, capsys):
    """Claim (a) on fig2a-cpu's grid, from its bundle alone: CEM attention 2 % worse than Llama
    at every seed, which is within the claim's 5 % margin; the other claims not run."""
    spec = load_spec(PAPER / "fig2a-cpu.yaml")
    ledger = Ledger(f"sqlite:///{tmp_path / 'trained.db'}")
    exp = ledger.ensure_experiment(spec.name, spec.workload, (PAPER / "fig2a-cpu.yaml").read_text())
    offsets = {"llama": 0.0, "llama-alibi": 0.01, "cem-attn": 0.02}
    for t in plan(spec):
        val = 100 * (1 + offsets[t.variant] + 0.001 * t.seed) * (
            1 + math.log2(t.lr / 0.008) ** 2 / 10)
        row = ledger.ensure_trial(exp.id, t.trial_id, dataset=t.dataset, variant=t.variant,
                                  size=t.size, lr=t.lr, seed=t.seed)
        ledger.update_trial(row.id, status=Status.FINISHED, val_metric=val, metric=1.02 * val)
    bundles.export_bundle(ledger, [spec.name], tmp_path / "bundle")
    home = tmp_path / "home"
    monkeypatch.setenv("CEMLAB_HOME", str(home))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")  # nothing there
    out = tmp_path / "report"
    assert main(["report", str(PAPER), "--from", str(tmp_path / "bundle"),
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "claims report from 1 bundle(s): " in printed
    text = (out / "REPORT.md").read_text()
    (row,) = [line for line in text.splitlines() if line.startswith("| (a) ")]
    assert "| **supports** |" in row
    # In plain words: each arm's effect is its offset's log ratio, averaged over the seeds.
    (words,) = [line for line in text.splitlines() if line.startswith("In plain words")]
    for control, offset in (("llama", 0.0), ("llama-alibi", 0.01)):
        effect = statistics.fmean(math.log((1.02 + 0.001 * s) / (1 + offset + 0.001 * s))
                                  for s in spec.seeds)
        assert (f"cem-attn's test perplexity is {100 * math.expm1(effect):.1f} % higher than "
                f"{control}'s, +") in words
    assert "(a) \"CEM attention (T=1) is within a few % of Llama" in words
    assert "parameters\": holds here (cem-attn's" in words and "Not run yet: (b), (c)" in words
    assert "**not run**" in text and (out / "claim-a.png").exists()
    assert not home.exists()  # no embedded store or ledger was made here
