"""The two engines behind the train loop agree: DeepSpeed ZeRO (what the Ray workers run, and
``cemlab train --engine deepspeed``) and plain PyTorch (``cemlab train``) give the same losses for
the same trial, and so does the DeepSpeed engine compiled (``engine.compile``)."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
CPU_ONLY = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # gloo and DeepSpeed's CPU accelerator

# One rank on the CPU, fp32: the language-model loop with a DeepSpeed engine, with a torch
# engine, then with the DeepSpeed engine compiled; one layer, the compile of two cut by a third.
SCRIPT = """
import dataclasses, json, sys
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from tests.conftest import write_corpus
from tests.workloads.lm.test_workload import nano_job
from workloads.core.registry import get_workload
from workloads.runtime.session import LocalDeepSpeedSession, LocalSession, one_rank_process_group

from torch._dynamo.utils import counters

tmp = Path(sys.argv[2])
job = nano_job(write_corpus(tmp / "corpus"), tmp, micro=4, accum=2, steps=10, n_layer=1)
engine = job.trial.engine.model_copy(update={  # and more DeepSpeed config, from the spec
    "compile": True, "deepspeed": {"zero_optimization": {"contiguous_gradients": True}}})
compiled = dataclasses.replace(job, trial=dataclasses.replace(job.trial, engine=engine))
out = {}
with one_rank_process_group():
    for name, cls, job in [("deepspeed", LocalDeepSpeedSession, job),
                           ("torch", LocalSession, job),
                           ("compiled", LocalDeepSpeedSession, compiled)]:
        session = cls(job)
        final = get_workload(job.trial.workload).train(job, session)
        made = session.made
        out[name] = {"loss": [session.history["loss"][s] for s in range(1, 11)],
                     "lr": [session.history["lr"][s] for s in range(1, 11)],
                     "test_loss": final["test_loss"],
                     "compiled": made.compiled and made.engine.is_compiled,
                     "compile_s": session.clock.seconds["compile"],
                     "train_mfu": final["train_mfu"],
                     "graphs": counters["stats"]["unique_graphs"],
                     "contiguous": name != "torch" and made.engine.zero_contiguous_gradients()}
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_deepspeed_and_torch_engines_train_alike(tmp_path):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(ROOT), str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env=CPU_ONLY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    ds, torch_, compiled = out["deepspeed"], out["torch"], out["compiled"]
    assert ds["lr"] == pytest.approx(torch_["lr"], rel=1e-9)  # one schedule
    assert ds["loss"] == pytest.approx(torch_["loss"], rel=1e-4)  # one optimizer, one clip
    assert ds["test_loss"] == pytest.approx(torch_["test_loss"], rel=1e-4)
    assert ds["loss"][-1] < ds["loss"][0]
    # compile: auto is off on a CPU; set, the model and the loss go through Dynamo, and the
    # trial trains and evaluates to the same numbers (Inductor reorders fp32 sums)
    assert not ds["compiled"] and ds["graphs"] == torch_["graphs"] == 0
    assert compiled["compiled"] and compiled["graphs"] >= 2
    # one worker keeps no contiguous gradient buffer, unless engine.deepspeed asks for one
    assert not ds["contiguous"] and compiled["contiguous"]
    # its first step compiles: the clock's compile phase, out of the train phase's MFU
    assert ds["compile_s"] == 0 < compiled["compile_s"]
    assert compiled["train_mfu"] > 0
    assert compiled["loss"] == pytest.approx(ds["loss"], rel=1e-4)
    assert compiled["test_loss"] == pytest.approx(ds["test_loss"], rel=1e-4)


@pytest.mark.slow
def test_the_train_command_runs_a_trial_through_deepspeed(tmp_path):
    """``cemlab train --engine deepspeed``: the trial trains in a one-process group through
    DeepSpeed ZeRO-1 (named in the log and the final table) to a finite loss."""
    from tests.conftest import write_corpus

    corpus = write_corpus(tmp_path / "corpus")
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator", "train", "--preset", "nano", "--steps", "3",
         "--engine", "deepspeed", "--zero-stage", "1", "--corpus", corpus], cwd=ROOT,
        capture_output=True, text=True, timeout=600,
        env={**CPU_ONLY, "CEMLAB_HOME": str(tmp_path / "home")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert re.search(r"^engine +DeepSpeed ZeRO-1$", proc.stdout, re.M), proc.stdout
    losses = [float(x) for x in re.findall(r"step \d+/3 \| loss (\S+)", log)]
    assert losses and all(math.isfinite(x) for x in losses), log[-3000:]
    test_loss = float(re.search(r"^test_loss +(\S+)$", proc.stdout, re.M)[1])
    assert math.isfinite(test_loss)


def test_the_cpu_comm_op_is_built_into_the_extension_cache_before_any_trial():
    """What ``make setup`` runs: the op a CPU trial's DeepSpeed loads, built (or found) as a
    shared library, so that the first trial does not build it inside its startup; in this
    environment's own extension cache, which another checkout's environment does not rebuild.
    DeepSpeed came in without MLflow (its autotuner's import), which still imports after it."""
    code = ("import sys; from workloads.runtime.engine import build_cpu_comm_op; "
            "op = build_cpu_comm_op(); mlflow_in = 'mlflow' in sys.modules; import mlflow; "
            "print('OP', op.__file__, hasattr(op, 'initialize'), mlflow_in, "
            "hasattr(mlflow, 'MlflowClient'))")
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True, env=env).stdout
    path, has_initialize, mlflow_with_deepspeed, mlflow_after = out.split("OP ", 1)[1].split()
    assert Path(path).is_file() and path.endswith(".so") and "shm_comm" in Path(path).name
    assert has_initialize == "True"
    assert Path(path).is_relative_to(Path(sys.prefix) / "torch_extensions")
    assert (mlflow_with_deepspeed, mlflow_after) == ("False", "True")
