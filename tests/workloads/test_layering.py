"""The layering rule: workloads import neither ray, deepspeed, mlflow nor the orchestrator at
module level, so models and the in-process trainer run with torch alone."""

import pkgutil
import subprocess
import sys
from pathlib import Path

import workloads

ROOT = Path(__file__).resolve().parents[2]


def test_no_workloads_module_pulls_in_ray_deepspeed_mlflow_or_the_orchestrator():
    modules = [m.name for m in pkgutil.walk_packages(workloads.__path__, "workloads.")]
    assert {"workloads.train", "workloads.session", "workloads.language_model",
            "workloads.gp.workload", "workloads.bench"} <= set(modules)
    code = ("import importlib, sys\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            "bad = sorted({n.split('.')[0] for n in sys.modules} & "
            "{'ray', 'deepspeed', 'mlflow', 'orchestrator'})\n"
            "print(','.join(bad))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == ""
