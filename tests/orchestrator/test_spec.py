"""Specs: strict validation with one-line errors, and plans that run nothing."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orchestrator.cli import main
from orchestrator.plan import plan, trial_id
from orchestrator.spec import SpecError, load_spec, parse_spec
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "experiments" / "demo.yaml"


def cli(*args: str, home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "CEMLAB_HOME": str(home)}
    env.pop("RAY_ADDRESS", None)
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=120)


def demo_with(tmp_path: Path, patch) -> Path:
    data = yaml.safe_load(DEMO.read_text())
    patch(data)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(("patch", "field"), [
    (lambda d: d["training"].update(learning_rate=0.1), "training.learning_rate: unknown key"),
    (lambda d: d["variants"]["cem"].update(atention="cem"), "variants.cem.atention: unknown key"),
    (lambda d: d["training"].update(tokens="lots"), "training.tokens: Input should be a valid"),
    (lambda d: d["variants"]["cem"].update(mlp="moe"), "variants.cem.mlp: Input should be"),
    (lambda d: d.update(data={"source": "text_files", "paths": "/nonexistent/*.txt"}),
     "data.paths: no corpus file matches '/nonexistent/*.txt'"),
    (lambda d: d["training"].update(batch_size=15), "training.batch_size: 15 is not a multiple"),
    (lambda d: d.update(learning_rates=[0.001, -0.1]), "learning_rates: every learning rate"),
    (lambda d: d.update(seeds=[1, 1]), "seeds: seeds must be distinct"),
    (lambda d: d["training"].update(budget_scale={"nano": 1.0}),
     "training.budget_scale: needs one scale per size ['micro'], got ['nano']"),
    (lambda d: d["training"].update(budget_scale={"micro": 0}), "training.budget_scale"),
    (lambda d: d.update(sizes=["llama-1b"]), "sizes: unknown preset(s) llama-1b"),
    (lambda d: d.update(data={"source": "slimpajama"}), "data.max_documents: required"),
    (lambda d: d.update(data={"source": "slimpajama", "max_documents": 9,
                              "dataset": "/nonexistent/sp"}),
     "data.dataset: no such directory '/nonexistent/sp'"),
    (lambda d: d["data"].update(tokenizer="./no-tokenizer-here"),
     "data.tokenizer: no such directory './no-tokenizer-here'"),
])
def test_malformed_spec_fails_fast_with_one_line_naming_the_field(tmp_path, monkeypatch, capsys,
                                                                  patch, field):
    home = tmp_path / "home"
    monkeypatch.setenv("CEMLAB_HOME", str(home))
    assert main(["run", str(demo_with(tmp_path, patch))]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and field in lines[0], err
    # Nothing started: no Ray instance, no MLflow store, no data cache, nothing printed.
    assert not home.exists()
    assert out == ""


def test_the_cli_exits_2_with_one_line_and_starts_nothing(tmp_path):
    home = tmp_path / "home"
    proc = cli("run", str(demo_with(tmp_path, lambda d: d.update(seeds=[1, 1]))), home=home)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'spec.yaml'}: seeds: seeds must be distinct"]
    assert not home.exists()


def test_invalid_yaml_and_missing_file_are_one_line_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nsizes: [micro\n")
    with pytest.raises(SpecError, match=r"invalid YAML \(line \d+\)"):
        load_spec(bad)
    with pytest.raises(SpecError, match="cannot read spec"):
        load_spec(tmp_path / "missing.yaml")
    with pytest.raises(SpecError, match="expected a mapping"):
        parse_spec([1, 2])


def test_plan_prints_every_trial_and_runs_nothing(tmp_path):
    home = tmp_path / "home"
    proc = cli("plan", str(DEMO), home=home)
    assert proc.returncode == 0, proc.stderr
    spec = load_spec(DEMO)
    trials = plan(spec)
    assert len(trials) == 4
    for t in trials:
        assert t.trial_id in proc.stdout and t.variant in proc.stdout
        assert f"{t.params['total']:,}" in proc.stdout
        assert t.steps * spec.training.batch_size * t.model.context_length == t.tokens
        assert t.tokens >= spec.training.tokens
    assert not home.exists()


def test_trial_id_is_the_science_not_the_resources():
    spec = load_spec(DEMO)
    fewer_workers = parse_spec({**spec.model_dump(), "resources": {"num_workers": 1}})
    smaller_micro = parse_spec({**spec.model_dump(),
                                "training": {**spec.training.model_dump(), "micro_batch_size": 4,
                                             "zero_stage": 3}})
    more_lrs = parse_spec({**spec.model_dump(), "learning_rates": [0.002, 0.004]})
    other_decay = parse_spec({**spec.model_dump(),
                              "training": {**spec.training.model_dump(), "weight_decay": 0.0}})
    ids = [t.trial_id for t in plan(spec)]
    assert [t.trial_id for t in plan(fewer_workers)] == ids
    assert [t.trial_id for t in plan(smaller_micro)] == ids
    grown = plan(more_lrs)  # the old trials keep their ids; the new LR adds new ones
    assert {t.trial_id for t in grown if t.lr == 0.002} == set(ids)
    assert len({t.trial_id for t in grown}) == 8
    assert not set(ids) & {t.trial_id for t in plan(other_decay)}
    model = spec.variants["cem"].resolve("micro", 4096)
    assert trial_id(spec, model, "shakespeare", 0.002, 0, 1) != trial_id(
        spec, model, "shakespeare", 0.002, 1, 1)


def test_services_that_do_not_answer_are_one_line_before_anything_starts(
        tmp_path, monkeypatch, capsys, postgres_with_password):
    host, port, user, password = postgres_with_password
    spec = str(demo_with(tmp_path, lambda d: None))
    monkeypatch.setenv("CEMLAB_HOME", str(tmp_path / "home"))
    closed = free_port()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{closed}")
    assert main(["run", spec]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip().splitlines() == [
        f"error: MLFLOW_TRACKING_URI http://127.0.0.1:{closed}: no answer (Connection refused)"]

    monkeypatch.setenv("CEMLAB_LEDGER_URL",
                       f"postgresql+psycopg2://{user}:wrong-{password}@{host}:{port}/postgres")
    assert main(["run", spec]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip().splitlines() == [
        f"error: CEMLAB_LEDGER_URL postgresql+psycopg2://{user}:***@{host}:{port}/postgres: "
        f'password authentication failed for user "{user}"']
    assert password not in err
    assert not (tmp_path / "home" / "data").exists()  # no corpus was prepared
