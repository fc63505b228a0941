"""Specs: strict validation with one-line errors, and plans that run nothing."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orchestrator.cli import main
from orchestrator.planning.plan import plan, trial_id
from orchestrator.planning.spec import SpecError, load_spec, parse_spec
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "experiments" / "demo-grid.yaml"


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
    (lambda d: d["budget"].update(tokens="lots"), "budget.tokens: Input should be a valid"),
    (lambda d: d["training"].update(zero_stage=2),
     "training.zero_stage: moved to engine.zero_stage"),
    (lambda d: d["training"].update(tokens=8), "training.tokens: moved to budget.tokens"),
    (lambda d: d["variants"]["cem"].update(mlp="moe"), "variants.cem.mlp: Input should be"),
    (lambda d: d.update(data={"source": "text_files", "paths": "/nonexistent/*.txt"}),
     "data.paths: no corpus file matches '/nonexistent/*.txt'"),
    (lambda d: d["training"].update(batch_size=15), "training.batch_size: 15 is not a multiple"),
    (lambda d: d.update(learning_rates=[0.001, -0.1]), "learning_rates: every learning rate"),
    (lambda d: d["training"].update(eval_steps=[2, 0]),
     "training.eval_steps: recursion steps must be distinct integers >= 1"),
    (lambda d: (d["training"].update(eval_steps=[1, 4]), d.update(variants={"llama": {}})),
     "training.eval_steps: no variant has a CEM sublayer to run at other recursion steps"),
    (lambda d: (d["training"].update(eval_steps=[1, 4]), d["variants"]["cem"].update(
        update="momentum", attn_steps=2)),
     "training.eval_steps: T_eval 1: update 'momentum' with momentum_scope 'step'"),
    (lambda d: d.update(learning_rates={"grid": [0.001]}),
     "learning_rates.grid: extending needs at least two learning rates"),
    (lambda d: d.update(learning_rates={"grid": [0.001, 0.002, 0.004], "max_points": 2}),
     "learning_rates.max_points: 2 is fewer than the grid's 3 learning rates"),
    (lambda d: d.update(learning_rates={"grid": [0.001, 0.0]}),
     "learning_rates.grid: every learning rate must be > 0"),
    (lambda d: d.update(learning_rates={"grid": [0.001, 0.002], "extent": True}),
     "learning_rates.extent: unknown key"),
    (lambda d: d.update(learning_rates={"max_points": 4}), "learning_rates.grid: Field required"),
    (lambda d: d.update(learning_rates={"grid": [0.001, "x"]}),
     "learning_rates.grid.1: Input should be a valid number"),
    (lambda d: d.update(seeds=[1, 1]), "seeds: seeds must be distinct"),
    (lambda d: d["budget"].update(budget_scale={"nano": 1.0}),
     "budget.budget_scale: needs one scale per size ['micro'], got ['nano']"),
    (lambda d: d["budget"].update(budget_scale={"micro": 0}), "budget.budget_scale"),
    (lambda d: d.update(sizes=["llama-1b"]), "sizes: unknown preset(s) llama-1b"),
    (lambda d: d.update(data={"source": "slimpajama"}), "data.max_documents: required"),
    (lambda d: d.update(data={"source": "slimpajama", "max_documents": 9,
                              "dataset": "/nonexistent/sp"}),
     "data.dataset: no such directory '/nonexistent/sp'"),
    (lambda d: d["data"].update(tokenizer="./no-tokenizer-here"),
     "data.tokenizer: no such directory './no-tokenizer-here'"),
    # wrong types: no coercion of strings or booleans into numbers
    (lambda d: d.update(learning_rates=["0.002"]), "learning_rates.0: Input should be a valid"),
    (lambda d: d.update(learning_rates=[True]), "learning_rates.0: Input should be a valid"),
    (lambda d: d["resources"].update(num_workers="2"), "resources.num_workers: Input should"),
    (lambda d: d.update(sizes="micro"), "sizes: Input should be a valid list"),
    (lambda d: d.update(variants=["llama", "cem"]), "variants: Input should be a valid dict"),
    (lambda d: d["variants"].update(cem=None), "variants.cem: Input should be a valid dict"),
    (lambda d: d.update(training=[1, 2]), "training: Input should be a valid dictionary"),
    # unknown keys at every level
    (lambda d: d.update(epochs=3), "epochs: unknown key"),
    (lambda d: d["resources"].update(gpus=1), "resources.gpus: unknown key"),
    (lambda d: d["data"].update(shuffle=True), "data.shuffle: unknown key"),
    (lambda d: d.update(gp={"kernels": ["rbf"]}), "gp: unknown key (workload language_model"),
    # zero and negative sizes, learning rates <= 0, NaN and infinities
    (lambda d: d["variants"]["cem"].update(d_model=0), "variants.cem: d_model must be >= 1"),
    (lambda d: d["variants"]["cem"].update(n_layer=-2), "variants.cem: n_layer must be >= 1"),
    (lambda d: d["variants"]["cem"].update(attn_steps=0), "variants.cem: attn_steps must be"),
    (lambda d: d["training"].update(batch_size=0), "training.batch_size: Input should be great"),
    (lambda d: d["budget"].update(tokens=-5), "budget.tokens: Input should be greater"),
    (lambda d: d.update(learning_rates=[0.0]), "learning_rates: every learning rate must be > 0"),
    (lambda d: d.update(learning_rates=[float("nan")]), "learning_rates.0: Input should be a fin"),
    (lambda d: d.update(learning_rates=[float("inf")]), "learning_rates.0: Input should be a fin"),
    (lambda d: d["budget"].update(budget_scale=float("inf")),
     "budget.budget_scale: Input should be a finite number"),
    (lambda d: d["variants"]["cem"].update(attn_step_size=float("nan")),
     "variants.cem.attn_step_size: Input should be a finite number"),
    (lambda d: d["variants"]["cem"].update(d_mlp_scale=float("inf")),
     "variants.cem.d_mlp_scale: Input should be a finite number"),
    (lambda d: d.update(seeds=[-1]), "seeds.0: Input should be greater than or equal to 0"),
    (lambda d: d.update(name="../escape"), "name: String should match pattern"),
    (lambda d: d.update(workload="vision"), "workload: unknown workload 'vision'"),
    (lambda d: d["engine"].update(zero_stage=4), "engine.zero_stage: Input should be 0, 1,"),
    # only DeepSpeed's engine compiles: GP regression trains on the plain one
    (lambda d: (d.pop("data"), d["engine"].update(compile=True), d.update(
        workload="gp_regression", sizes=["gp-small"], variants={"t1": {"mlp_steps": 1}})),
     "engine.compile: workload gp_regression trains on the plain PyTorch engine (DDP), which "
     "does not compile"),
    (lambda d: d["engine"].update(deepspeed={"train_batch_size": 64}),
     "engine.deepspeed: train_batch_size is set by the spec's own fields"),
    (lambda d: d["engine"].update(deepspeed={"bf16": False}),
     "engine.deepspeed: bf16 must be a mapping of DeepSpeed's bf16 keys"),
    (lambda d: d["engine"].update(deepspeed={"torch_autocast": {"enabled": True}}),
     "engine.deepspeed: torch_autocast is set by the spec's own fields"),
    (lambda d: d["data"].update(tokenizer="not a tokenizer!"),
     "data.tokenizer: 'not a tokenizer!' is neither a directory nor a Hugging Face hub name"),
    # a grid over the cap (MAX_TRIALS) without --yes
    (lambda d: d.update(seeds=list(range(2500))),
     "the grid has 10,000 trials, more than 1,000: check its axes, or pass --yes"),
])
def test_malformed_spec_fails_fast_with_one_line_naming_the_field(tmp_path, monkeypatch, capsys,
                                                                  patch, field):
    assert_refused_before_anything(demo_with(tmp_path, patch), field, tmp_path, monkeypatch,
                                   capsys)


def assert_refused_before_anything(spec: Path, field: str, tmp_path, monkeypatch, capsys):
    """``run spec`` exits 2 with one line containing ``field``, and starts or writes nothing."""
    import ray

    home = tmp_path / "home"
    monkeypatch.setenv("CEMLAB_HOME", str(home))
    assert main(["run", str(spec)]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {spec}: ") and field in lines[0], err
    # Nothing started: no Ray instance, no MLflow store or ledger (both default under the home),
    # no data cache, nothing printed.
    assert not ray.is_initialized()
    assert not home.exists()
    assert out == ""


BOMB = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [{', '.join([f'*{p}'] * 10)}]\n" for p, c in zip("abcdef", "bcdefg"))


@pytest.mark.parametrize(("content", "field"), [
    (b"name: a\nname: b\nsizes: [micro]\n", "invalid YAML (line 2): duplicate key 'name'"),
    (BOMB.encode() + b"name: [*g]\n", "YAML aliases expand to more than 100,000 nodes"),
    (b"a: &a [*a]\n", "a YAML alias refers to its own anchor"),
    (b"name: x\ndescription: '" + b"x" * 10_000_000 + b"'\n", "larger than 1024 KiB"),
    (bytes(range(256)) * 4, "not UTF-8 text (byte 0x80 at offset 128)"),
    ("name: café\n".encode("latin-1"), "not UTF-8 text (byte 0xe9 at offset 9)"),
    (b"name: x\x00\n", "invalid YAML: unacceptable character #x0000"),
    (b"name: !!python/object/apply:os.system [echo]\n", "could not determine a constructor"),
    (b"", "expected a mapping at the top level, got NoneType"),
    (b"- a\n- b\n", "expected a mapping at the top level, got list"),
])
def test_malformed_spec_files_fail_fast_with_one_line(tmp_path, monkeypatch, capsys, content,
                                                      field):
    spec = tmp_path / "spec.yaml"
    spec.write_bytes(content)
    assert_refused_before_anything(spec, field, tmp_path, monkeypatch, capsys)


@pytest.mark.parametrize(("files", "problem"), [
    ({"a.txt": b"", "b.txt": b"  \n"}, "none of the 2 files matching '{glob}' is UTF-8 text: "
     "a.txt: empty; b.txt: empty"),
    ({"a.txt": b"\x89PNG\r\n\x1a\n\x00\x00"}, "none of the 1 files matching '{glob}' is "
     "UTF-8 text: a.txt: binary (NUL bytes)"),
    ({"a.txt": "Ça va\n".encode("cp1252")}, "none of the 1 files matching '{glob}' is UTF-8 "
     "text: a.txt: not UTF-8 (byte 0xc7 at offset 0)"),
    ({}, "no corpus file matches '{glob}'"),
])
def test_a_corpus_without_text_is_refused_before_anything(tmp_path, monkeypatch, capsys, files,
                                                          problem):
    (tmp_path / "corpus").mkdir()
    for name, content in files.items():
        (tmp_path / "corpus" / name).write_bytes(content)
    glob = str(tmp_path / "corpus" / "*.txt")
    spec = demo_with(tmp_path, lambda d: d.update(data={"source": "text_files", "paths": glob}))
    assert_refused_before_anything(spec, "data.paths: " + problem.format(glob=glob), tmp_path,
                                   monkeypatch, capsys)


def test_yaml_1_2_floats_and_aliases_that_stay_small_are_read(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text("name: x\nsizes: [micro]\nlearning_rates: [1e-3, 2E-3, .5e-2]\n"
                    "variants:\n  a: &cem {attention: cem}\n  b: *cem\n"
                    "budget: {tokens: 800000}\ntraining: {batch_size: 16}\n")
    loaded = load_spec(spec)
    assert loaded.learning_rates == [0.001, 0.002, 0.005]
    assert loaded.variants["a"] == loaded.variants["b"]


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
        assert t.tokens >= spec.budget.tokens
    assert not home.exists()


def test_trial_id_is_the_science_not_the_resources():
    spec = load_spec(DEMO)
    fewer_workers = parse_spec({**spec.model_dump(), "resources": {"num_workers": 1}})
    smaller_micro = parse_spec({**spec.model_dump(),
                                "training": {**spec.training.model_dump(),
                                             "micro_batch_size": 4},
                                "engine": {"zero_stage": 3}})
    more_lrs = parse_spec({**spec.model_dump(), "learning_rates": [0.002, 0.004]})
    other_decay = parse_spec({**spec.model_dump(),
                              "optimizer": {"weight_decay": 0.0}})
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


@pytest.mark.parametrize("name", ["demo.yaml", "paper/fig3a-cpu.yaml", "paper/gp-table-cpu.yaml"])
def test_grid_size_counts_the_trials_plan_makes(name):
    spec = load_spec(ROOT / "experiments" / name)
    assert spec.grid_size == len(plan(spec))


def test_yes_lets_a_grid_over_the_cap_through(tmp_path, monkeypatch, capsys):
    spec = str(demo_with(tmp_path, lambda d: d.update(seeds=list(range(2500)))))
    monkeypatch.setenv("CEMLAB_HOME", str(tmp_path / "home"))
    closed = free_port()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{closed}")
    assert main(["run", spec, "--yes"]) == 2  # past the cap, stopped by the next check
    assert capsys.readouterr().err.strip() == (
        f"error: MLFLOW_TRACKING_URI http://127.0.0.1:{closed}: no answer (Connection refused)")


def test_compile_is_refused_only_where_the_plain_engine_trains():
    """``engine.compile: true`` asks DeepSpeed's engine to compile (the language model); GP
    regression trains on the plain PyTorch engine, which never compiles: there it is refused,
    and ``auto`` or ``false`` (what that engine does) pass."""
    gp = {"name": "gp", "workload": "gp_regression", "sizes": ["gp-small"],
          "variants": {"t1": {"mlp_steps": 1}}}
    for setting in ("auto", False):
        assert parse_spec({**gp, "engine": {"compile": setting}}).engine.compile == setting
    with pytest.raises(SpecError, match=r"^gp\.yaml: engine\.compile: workload gp_regression "
                                        r"trains on the plain PyTorch engine"):
        parse_spec({**gp, "engine": {"compile": True}}, "gp.yaml")
    lm = {"name": "lm", "sizes": ["nano"], "variants": {"llama": {}}, "engine": {"compile": True}}
    assert parse_spec(lm).engine.compile is True


@pytest.mark.parametrize(("eval_seeds", "error"), [
    ([5, 5], "learning_rates.eval_seeds: seeds must be distinct"),
    ([1, 6], "learning_rates.eval_seeds: seed(s) 1 also tune (seeds): an evaluation seed must be "
             "fresh"),
    ([-1], "learning_rates.eval_seeds.0: Input should be greater than or equal to 0"),
    ("five", "learning_rates.eval_seeds: Input should be a valid list")])
def test_evaluation_seeds_are_fresh_and_distinct_in_one_line(eval_seeds, error):
    data = {"name": "evals", "sizes": ["nano"], "variants": {"llama": {}}, "seeds": [0, 1, 2],
            "learning_rates": {"grid": [0.001, 0.002], "eval_seeds": eval_seeds}}
    with pytest.raises(SpecError) as caught:
        parse_spec(data)
    assert str(caught.value) == f"spec: {error}"
    data["learning_rates"]["eval_seeds"] = [5, 6]
    assert parse_spec(data).eval_seeds == [5, 6]
    assert parse_spec({**data, "learning_rates": [0.001, 0.002]}).eval_seeds == []
