"""``cemlab train``: one trial in-process, from a preset or from a spec's plan."""

import argparse
import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CEMLAB = Path(sys.executable).parent / "cemlab"  # the console script


def train(*args: str, home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "CEMLAB_HOME": str(home)}
    for name in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI"):
        env.pop(name, None)
    return subprocess.run([str(CEMLAB), "train", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture
def train_here(tmp_path, monkeypatch, capsys, caplog):
    """``cemlab train ARGS`` in this process (3 s less than a new interpreter), with
    ``CEMLAB_HOME`` in ``tmp_path``: returns its stdout and its log; ``assert_fails`` instead
    returns the one line it printed to stderr as it exited with 2."""
    from orchestrator.cli import main

    monkeypatch.setenv("CEMLAB_HOME", str(tmp_path))
    for name in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)
    caplog.set_level(logging.INFO, logger="cemlab")

    def run(*args: str, fails: bool = False) -> tuple[str, str]:
        capsys.readouterr()
        caplog.clear()
        code = main(["train", *args])
        out, err = capsys.readouterr()
        assert code == (2 if fails else 0), err[-2000:]
        return (out, caplog.text) if not fails else (err.strip(), caplog.text)

    return run


def parse(*flags: str) -> argparse.Namespace:
    from orchestrator.execution.local_trial import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(flags))


def test_a_cem_preset_trains_cem_unless_a_flag_says_otherwise():
    """``--preset cem-134m`` is the preset itself (the paper's best CEM: CEM sublayers, T = 2,
    shared diagonal, preconditioners); ``--attention``/``--mlp`` replace only the kinds."""
    from orchestrator.execution.local_trial import preset_spec
    from workloads.core.architecture import ModelConfig

    def config(*flags: str) -> ModelConfig:
        spec = preset_spec(parse("--preset", *flags))
        (variant,) = spec.variants.values()
        return variant.resolve(spec.sizes[0], 1000)

    assert config("cem-134m") == ModelConfig.from_preset("cem-134m", vocab_size=1000)
    assert config("nano").attention == "llama" and config("nano").mlp == "llama"
    mixed = config("cem-134m", "--mlp", "llama")
    assert (mixed.attention, mixed.mlp, mixed.attn_steps) == ("cem", "llama", 2)


def test_a_preset_trains_in_process_and_prints_loss_and_perplexity(corpus_glob, tmp_path,
                                                                    monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    metrics = tmp_path / "out" / "metrics.json"
    proc = train("--preset", "nano", "--steps", "20", "--corpus", corpus_glob,
                 "--metrics-json", str(metrics), home=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    steps = [line for line in out.splitlines() if line.startswith("[train] step ")]
    assert [line.split()[2] for line in steps] == ["10/20", "20/20"]
    losses = [float(line.split("loss ")[1].split()[0]) for line in steps]
    assert losses[1] < losses[0]
    assert "test_perplexity" in proc.stdout and "in-process" in proc.stdout
    assert "torch, fp32" in out  # the plain engine: no DeepSpeed, no Ray, no MLflow server
    assert not (tmp_path / "mlflow.db").exists() and (tmp_path / "data").is_dir()
    written = json.loads(metrics.read_text())
    assert sorted(map(int, written["history"]["loss"])) == list(range(1, 21))
    assert math.isclose(written["history"]["loss"]["10"], losses[0], abs_tol=5e-5)
    assert written["final"]["test_perplexity"] == pytest.approx(
        math.exp(written["final"]["test_loss"]), rel=1e-6)
    # MFU: achieved model FLOP/s over the peak this machine measured once (and cached).
    final, history = written["final"], written["history"]
    (peak,) = json.loads((tmp_path / "cache" / "cemlab" / "peak_flops.json").read_text()).values()
    assert final["peak_flops_per_s"] == peak  # one worker
    assert history["mfu"]["20"] == pytest.approx(history["flops_per_s"]["20"] / peak)
    assert 0 < final["train_mfu"] < 1 and f"MFU {100 * history['mfu']['20']:.1f}%" in steps[1]
    assert final["peak_memory_mib"] > 100  # the interpreter with torch loaded, at least


def test_the_profile_splits_a_whole_train_step(corpus_glob, tmp_path, train_here):
    """``--profile N``: train steps 4 and 5 under the profiler, each alone, so the validation
    at step 4 (``eval_interval`` 2 of 8 steps) stays out: per step the 2 layers' attention
    runs forward and backward once each. The table has what the bench leaves out of a step
    (the optimizer step), the longest entries first, and the operators' own time fits within
    the steps' wall time."""
    metrics = tmp_path / "metrics.json"
    out, _ = train_here("--preset", "nano", "--steps", "8", "--corpus", corpus_glob,
                        "--profile", "40", "--metrics-json", str(metrics))
    assert "train steps 4-5, profiled: " in out and "Optimizer.step#AdamW.step" in out
    profile = json.loads(metrics.read_text())["profile"]
    calls = {k["kernel"]: k["calls_per_step"] for k in profile["kernels"]}
    assert calls["aten::_scaled_dot_product_flash_attention_for_cpu"] == 2
    assert calls["aten::_scaled_dot_product_flash_attention_for_cpu_backward"] == 2
    assert calls["Optimizer.step#AdamW.step"] == 1
    times = [k["ms_per_step"] for k in profile["kernels"]]
    assert times == sorted(times, reverse=True) and "aten::mm" in list(calls)[:3]
    assert 0 < sum(times) <= profile["busy_ms_per_step"] <= profile["wall_ms_per_step"]
    out, _ = train_here("--preset", "nano", "--steps", "4", "--corpus", corpus_glob,
                        "--profile", "5")
    assert "no profile: it needs 5 train steps" in out


def test_zero_stage_and_compile_flags_replace_the_trials_engine_settings():
    """``--zero-stage`` and ``--compile`` replace ``engine.zero_stage``/``engine.compile``
    of the trial (a preset's or a spec's), and only where given."""
    from orchestrator.execution.local_trial import with_engine_options
    from orchestrator.planning.plan import plan
    from orchestrator.planning.spec import SpecError, parse_spec
    from workloads.core.trial import Job

    spec = parse_spec({"name": "gp-one", "workload": "gp_regression", "sizes": ["gp-small"],
                       "variants": {"t1": {"mlp_steps": 1}}, "learning_rates": [0.004],
                       "engine": {"zero_stage": 2, "compile": "auto"}})
    job = Job(plan(spec)[0])
    args = parse("--spec", "s.yaml", "--trial", "0", "--zero-stage", "3", "--compile", "false")
    replaced = with_engine_options(job, args.zero_stage, args.compile).trial.engine
    assert (replaced.zero_stage, replaced.compile) == (3, False)
    assert with_engine_options(job, None, "true").trial.engine.compile is True
    assert with_engine_options(job, 0, None).trial.engine.compile == "auto"
    assert with_engine_options(job, None, None) is job
    tuned = with_engine_options(job, None, None, {"bf16": {"check_grad_overflow": False}})
    assert tuned.trial.engine.deepspeed == {"bf16": {"check_grad_overflow": False}}
    again = with_engine_options(tuned, None, None, {"bf16": {"immediate_grad_update": True}})
    assert again.trial.engine.deepspeed == {  # merged key by key, not replaced
        "bf16": {"check_grad_overflow": False, "immediate_grad_update": True}}
    assert tuned.trial.trial_id == job.trial.trial_id  # this run only: the planned id
    with pytest.raises(SpecError, match=r"^--deepspeed: .*zero_optimization\.stage is set by"):
        with_engine_options(job, None, None, {"zero_optimization": {"stage": 3}})
    with pytest.raises(SpecError, match=r"^--deepspeed: bf16 must be a mapping"):
        with_engine_options(job, None, None, {"bf16": False})
    with pytest.raises(SpecError, match=r"^--deepspeed: give a JSON object"):
        with_engine_options(job, None, None, [1])
    assert parse("--preset", "nano", "--deepspeed", '{"a": 1}').deepspeed == {"a": 1}
    assert parse("--preset", "nano").engine == "torch"


def test_a_spec_trial_runs_by_row_or_id_and_a_wrong_one_is_one_line(tmp_path, train_here):
    spec = {"name": "gp-one", "workload": "gp_regression",
            "gp": {"kernels": ["rbf"], "n_train": 256, "n_val": 32, "n_test": 64, "steps": 40},
            "sizes": ["gp-small"], "variants": {"t1": {"mlp_steps": 1}, "t2": {"mlp_steps": 2}},
            "learning_rates": [0.004], "training": {"batch_size": 32, "log_interval": 20}}
    path = tmp_path / "gp.yaml"
    path.write_text(yaml.safe_dump(spec))
    out, logged = train_here("--spec", str(path), "--trial", "1")
    assert "t2@gp-small lr=0.004 seed=0" in out and "test_rmse" in out
    assert "[train] step 40/40" in logged
    err, _ = train_here("--spec", str(path), "--trial", "7", fails=True)
    assert err == f"error: --trial '7': not a row (0..1) or trial id of {path}"
    err, _ = train_here("--spec", str(path), fails=True)
    assert err.startswith("error: --spec and --trial go together")
    err, _ = train_here("--spec", str(path), "--trial", "1", "--compile", "true", fails=True)
    assert err == ("error: --compile true: the plain PyTorch engine does not compile; add "
                   "--engine deepspeed")


def test_a_language_model_trial_runs_by_the_id_run_gives_it(corpus_glob, tmp_path, train_here):
    """``run`` ids cover the prepared corpus's content, ``plan``'s (no data yet) do not: both
    pick the same trial."""
    from orchestrator.planning.plan import plan
    from orchestrator.planning.spec import load_spec
    from workloads.core.registry import get_workload

    spec = {"name": "lm-one", "data": {"source": "text_files", "paths": corpus_glob,
                                       "vocab_size": 512},
            "sizes": ["nano"], "variants": {"llama": {}, "cem": {"attention": "cem"}},
            "learning_rates": [0.004],
            "budget": {"tokens": 4096},
            "training": {"batch_size": 8, "eval_interval": 4, "eval_sequences": 8}}
    path = tmp_path / "lm.yaml"
    path.write_text(yaml.safe_dump(spec))
    loaded = load_spec(path)
    prepared = get_workload("language_model").prepare(loaded.workload_config,
                                                      str(tmp_path / "data"))
    run_id, plan_id = (next(t.trial_id for t in trials if t.variant == "cem")
                       for trials in (plan(loaded, prepared.data), plan(loaded)))
    assert run_id != plan_id  # the corpus content is part of a run's identity
    for trial in (run_id, plan_id):
        out, _ = train_here("--spec", str(path), "--trial", trial)
        assert "cem@nano lr=0.004 seed=0" in out


def test_a_multi_worker_spec_trial_takes_its_whole_batch_per_step_in_process(
        corpus_glob, tmp_path, train_here):
    """The plan gives each of 2 workers 4 of the 8 sequences per step; the one in-process
    worker takes all 8 (4 per micro-batch, 2 accumulated): the same steps, loss for loss, as the
    spec planned for 1 worker."""
    histories = {}
    for workers in (1, 2):
        spec = {"name": f"lm-{workers}", "data": {"source": "text_files", "paths": corpus_glob,
                                                  "vocab_size": 512},
                "sizes": ["nano"], "variants": {"llama": {}}, "learning_rates": [0.004],
                "budget": {"tokens": 6 * 8 * 64},
                "training": {"batch_size": 8, "micro_batch_size": 4, "eval_interval": 3,
                             "eval_sequences": 8, "log_interval": 3},
                "engine": {"precision": "fp32"},
                "resources": {"num_workers": workers}}
        path, metrics = tmp_path / f"lm-{workers}.yaml", tmp_path / f"m-{workers}.json"
        path.write_text(yaml.safe_dump(spec))
        out, _ = train_here("--spec", str(path), "--trial", "0", "--metrics-json",
                            str(metrics))
        assert "(4 per micro-batch x 2 accumulated per step)" in out
        histories[workers] = json.loads(metrics.read_text())["history"]["loss"]
    assert sorted(map(int, histories[2])) == list(range(1, 7))
    assert histories[2] == histories[1]


def test_several_trials_of_a_spec_train_as_one_stack(corpus_glob, tmp_path, train_here):
    """``--trial 0,1,2``: three learning rates of one arm (the plan's first three rows) in one
    stack, a column each; trials of two arms (another architecture) cannot share one, and say
    so in one line."""
    spec = {"name": "lm-stack", "data": {"source": "text_files", "paths": corpus_glob,
                                         "vocab_size": 512},
            "sizes": ["nano"], "variants": {"cem": {"attention": "cem"}, "llama": {}},
            "learning_rates": [0.002, 0.004, 0.008], "budget": {"tokens": 6 * 8 * 64},
            "training": {"batch_size": 8, "eval_interval": 3, "eval_sequences": 8,
                         "log_interval": 3},
            "engine": {"precision": "fp32"}}
    path = tmp_path / "lm.yaml"
    path.write_text(yaml.safe_dump(spec))
    out, logged = train_here("--spec", str(path), "--trial", "0,1,2")
    assert "3 trials of cem@nano" in out and "a stack of 3 trials" in logged
    header = next(line for line in out.splitlines() if line.startswith("metric"))
    assert [f"cem@nano lr={lr} seed=0" in header for lr in (0.002, 0.004, 0.008)] == [True] * 3
    row = next(line for line in out.splitlines() if line.startswith("test_perplexity"))
    assert len({float(v.replace(",", "")) for v in row.split()[1:]}) == 3
    err, _ = train_here("--spec", str(path), "--trial", "0,3", fails=True)
    assert err.splitlines()[-1].startswith("error: --trial: llama@nano lr=0.002 seed=0 (")
    assert "differs from cem@nano lr=0.002 seed=0" in err and "more than lr and seed" in err
