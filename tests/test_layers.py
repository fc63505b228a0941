"""The layers of the code, stated as import-linter contracts in ``pyproject.toml``: each package
imports only those below it, and so does each of the orchestrator's subpackages; the
orchestrator and the dashboard reach the workloads through their core alone, the dashboard
imports nothing that launches trials, and no modules import each other in a circle."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dashboards", "orchestrator", "workloads")


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` over the packages under ``root``, with its ``pyproject.toml``."""
    script = Path(sys.executable).parent / "lint-imports"  # import-linter's command
    return subprocess.run([str(script), "--no-cache"], cwd=root,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(root)})


def test_every_contract_is_kept():
    out = lint_imports(ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "6 kept, 0 broken" in out.stdout


def test_an_import_up_a_layer_breaks_a_contract(tmp_path):
    """A copy of the code in which the core imports the runtime (an arrow up, and with the
    runtime's imports of the core a circle), the orchestrator the language model (past the
    core), the orchestrator's records its science (an arrow up, and a circle) and the dashboard
    the orchestrator's execution: the five contracts that forbid them break, naming the
    imports."""
    for name in PACKAGES:
        shutil.copytree(ROOT / name, tmp_path / name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    with open(tmp_path / "workloads" / "core" / "trial.py", "a") as f:
        f.write("\nimport workloads.runtime.session  # noqa\n")
    with open(tmp_path / "orchestrator" / "planning" / "plan.py", "a") as f:
        f.write("\nimport workloads.lm.memory  # noqa\n")
    with open(tmp_path / "orchestrator" / "records" / "ledger.py", "a") as f:
        f.write("\nimport orchestrator.science.results  # noqa\n")
    with open(tmp_path / "dashboards" / "reads.py", "a") as f:
        f.write("\nimport orchestrator.execution.launch  # noqa\n")
    out = lint_imports(tmp_path)
    assert out.returncode != 0
    assert "1 kept, 5 broken" in out.stdout, out.stdout[-3000:]  # all but the packages' layers
    assert "workloads.core is not allowed to import workloads.runtime" in out.stdout
    assert "orchestrator is not allowed to import workloads.lm" in out.stdout
    assert "orchestrator.planning.plan -> workloads.lm.memory" in out.stdout
    assert "orchestrator.records is not allowed to import orchestrator.science" in out.stdout
    assert "orchestrator.records.ledger -> orchestrator.science.results" in out.stdout
    assert "dashboards is not allowed to import orchestrator.execution" in out.stdout
