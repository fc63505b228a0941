"""The two engines behind the train loop agree: DeepSpeed ZeRO (what the Ray workers run) and
plain PyTorch (what ``python -m workloads.train`` runs) give the same losses for the same trial,
and so does the DeepSpeed engine compiled (``training.compile``)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# One rank, fp32: the language-model loop with a DeepSpeed engine, with a torch engine, then
# with the DeepSpeed engine compiled.
SCRIPT = """
import dataclasses, json, os, socket, sys
os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK="0", RANK="0", WORLD_SIZE="1")
import torch.distributed as dist
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from tests.conftest import write_corpus
from tests.workloads.test_language_model import nano_job
from workloads.registry import get_workload
from workloads.engine import DeepSpeedEngine
from workloads.session import LocalSession

from torch._dynamo.utils import counters

class DeepSpeedSession(LocalSession):
    def engine(self, model, backend):
        self.made = DeepSpeedEngine(model, self.job.trial, 1, self.precision)
        return self.made

tmp = Path(sys.argv[2])
job = nano_job(write_corpus(tmp / "corpus"), tmp, micro=4, accum=2, steps=10)
training = job.trial.training.model_copy(update={"compile": True})
compiled = dataclasses.replace(job, trial=dataclasses.replace(job.trial, training=training))
out = {}
for name, cls, job in [("deepspeed", DeepSpeedSession, job), ("torch", LocalSession, job),
                       ("compiled", DeepSpeedSession, compiled)]:
    session = cls(job)
    final = get_workload(job.trial.workload).train(job, session)
    made = getattr(session, "made", None)
    out[name] = {"loss": [session.history["loss"][s] for s in range(1, 11)],
                 "lr": [session.history["lr"][s] for s in range(1, 11)],
                 "test_loss": final["test_loss"],
                 "compiled": made is not None and made.compiled and made.engine.is_compiled,
                 "compile_s": session.clock.seconds["compile"],
                 "train_mfu": final["train_mfu"],
                 "graphs": counters["stats"]["unique_graphs"]}
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_deepspeed_and_torch_engines_train_alike(tmp_path):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(ROOT), str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
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
    # its first step compiles: the clock's compile phase, out of the train phase's MFU
    assert ds["compile_s"] == 0 < compiled["compile_s"]
    assert compiled["train_mfu"] > 0
    assert compiled["loss"] == pytest.approx(ds["loss"], rel=1e-4)
    assert compiled["test_loss"] == pytest.approx(ds["test_loss"], rel=1e-4)


def test_the_cpu_comm_op_is_built_into_the_extension_cache_before_any_trial():
    """What ``make setup`` runs: the op a CPU trial's DeepSpeed loads, built (or found) as a
    shared library, so that the first trial does not build it inside its startup; in this
    environment's own extension cache, which another checkout's environment does not rebuild."""
    code = ("from workloads.engine import build_cpu_comm_op; op = build_cpu_comm_op(); "
            "print('OP', op.__file__, hasattr(op, 'initialize'))")
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True, env=env).stdout
    path, has_initialize = out.split("OP ", 1)[1].split()
    assert Path(path).is_file() and path.endswith(".so") and "shm_comm" in Path(path).name
    assert has_initialize == "True"
    assert Path(path).is_relative_to(Path(sys.prefix) / "torch_extensions")
