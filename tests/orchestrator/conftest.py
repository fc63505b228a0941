"""Local CEM Lab services for the end-to-end tests: a token-authenticated Ray head and an MLflow
server (basic auth) started by infra/local/up.sh in a temporary CEMLAB_HOME, stopped by down.sh."""

import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from infra.local.services_env import read_services_env

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def local_services(home: Path, **extra_env: str):
    """up.sh in ``home`` (with ``extra_env``, e.g. a storage root), yields ``(home, env)`` where
    ``env`` is this process's environment plus services.env; down.sh on exit, checking it
    stopped exactly the processes up.sh started."""
    env = {**os.environ, "CEMLAB_HOME": str(home), "VENV_BIN": str(Path(sys.executable).parent),
           "CEMLAB_RAY_PORT": "0", "CEMLAB_RAY_DASHBOARD_PORT": "0", "CEMLAB_MLFLOW_PORT": "0",
           "CEMLAB_RAY_CPUS": "2", **extra_env}
    try:
        subprocess.run([str(ROOT / "infra/local/up.sh")], env=env, check=True, timeout=300)
    except BaseException:
        subprocess.run([str(ROOT / "infra/local/down.sh")], env=env, timeout=120)
        raise
    pids = [int((home / "run" / f"{name}.pid").read_text()) for name in ("ray", "mlflow")]
    try:
        yield home, {**os.environ, **extra_env, **read_services_env(home / "services.env")}
    finally:
        subprocess.run([str(ROOT / "infra/local/down.sh")], env=env, timeout=120)
        for pid in pids:  # down.sh stopped exactly what up.sh started
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    """The local stack as a cluster head runs it: MLflow behind its basic-auth app."""
    with local_services(tmp_path_factory.mktemp("cemlab_home"),
                        CEMLAB_MLFLOW_AUTH="basic") as started, pytest.MonkeyPatch.context() as mp:
        for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):  # this process's
            mp.setenv(name, started[1][name])  # MlflowClients log in as the subprocesses do
        yield started


def stack_logs(home: Path, env: dict) -> str:
    """Every log of the local stack in ``home``: its own (``home/logs``) and Ray's, in the
    stack's Ray temp dir (``CEMLAB_RAY_TEMP_DIR``; Ray's ``.log`` files under 16 MiB)."""
    logs = "".join(p.read_text(errors="replace") for p in (home / "logs").rglob("*")
                   if p.is_file())
    return logs + "".join(p.read_text(errors="replace")
                          for p in Path(env["CEMLAB_RAY_TEMP_DIR"]).rglob("*.log")
                          if p.is_file() and p.stat().st_size < 2**24)


def orchestrator(env: dict, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """``python -m orchestrator ARGS`` against the stack of ``env``; its output captured."""
    return orchestrators(env, args, timeout=timeout)[0]


def orchestrators(env: dict, *commands: tuple[str, ...],
                  timeout: int = 900) -> list[subprocess.CompletedProcess]:
    """``orchestrator`` of each of ``commands``, all at once (commands that need nothing of each
    other): a short command is mostly its interpreter's start and imports, which overlap.
    Several at once share the cores, so their OpenMP threads wait passively unless ``env``
    says otherwise (spinning, the grid test's eight models commands took 55 s, 28 s passive)."""
    shared = {"OMP_WAIT_POLICY": "PASSIVE"} if len(commands) > 1 else {}
    procs = [subprocess.Popen([sys.executable, "-m", "orchestrator", *args], cwd=ROOT,
                              env={**shared, **env, "RAY_ADDRESS": env["CEMLAB_RAY_GCS_ADDRESS"]},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for args in commands]
    deadline = time.monotonic() + timeout
    done = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


def write_spec(tmp_path: Path, spec: dict) -> Path:
    path = tmp_path / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path
