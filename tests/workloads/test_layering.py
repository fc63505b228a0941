"""The layering rule: workloads import neither ray, deepspeed, mlflow nor the orchestrator at
module level, so models and the in-process trainer run with torch alone. The MLflow flavour of
a registered model (``workloads.lm.serving``, ``workloads.lm.serving_model``) is MLflow's by nature:
it may import mlflow, and nothing else of those."""

import pkgutil
import subprocess
import sys
from pathlib import Path

import workloads

ROOT = Path(__file__).resolve().parents[2]


def imported(modules: list[str], banned: set[str]) -> str:
    """The banned top-level packages that importing ``modules`` in a fresh interpreter pulls
    in, comma-separated."""
    code = ("import importlib, sys\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            f"print(','.join(sorted({{n.split('.')[0] for n in sys.modules}} & {banned!r})))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip()


def test_no_workloads_module_pulls_in_ray_deepspeed_mlflow_or_the_orchestrator():
    modules = [m.name for m in pkgutil.walk_packages(workloads.__path__, "workloads.")]
    serving = [m for m in modules if m.startswith("workloads.lm.serving")]
    assert {"workloads.runtime.worker", "workloads.runtime.session", "workloads.lm.workload",
            "workloads.gp.workload", "workloads.lm.step_bench"} <= set(modules)
    assert serving == ["workloads.lm.serving", "workloads.lm.serving_model"]
    rest = [m for m in modules if m not in serving]
    assert imported(rest, {"ray", "deepspeed", "mlflow", "orchestrator"}) == ""
    assert imported(serving, {"ray", "deepspeed", "mlflow", "orchestrator"}) == "mlflow"


def test_the_models_and_the_bench_need_torch_and_tabulate_alone():
    """``python -m workloads.lm.step_bench`` runs on a GPU machine whose image has torch but none of
    the trial stack (an H200 image here had no pydantic): no spec, data or tracking package."""
    stack = {"pydantic", "pydantic_settings", "tokenizers", "pyarrow", "yaml", "sqlalchemy",
             "pandas", "scipy", "ray", "deepspeed", "mlflow", "orchestrator"}
    assert imported(["workloads.models", "workloads.lm.step_bench", "workloads.lm.attention_bench"],
                    stack) == ""


def test_one_trial_in_process_needs_no_services_packages():
    """``cemlab train`` runs a trial on a machine without Ray, MLflow, a database or the
    dashboard (a GPU box whose image has none of them): its command and the language-model
    workload it trains import none."""
    stack = {"ray", "mlflow", "sqlalchemy", "alembic", "streamlit", "plotly", "pandas"}
    assert imported(["orchestrator.cli", "orchestrator.execution.local_trial",
                     "workloads.lm.workload", "workloads.gp.workload",
                     "workloads.runtime.worker"], stack) == ""
