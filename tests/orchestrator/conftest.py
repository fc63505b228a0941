"""Local CEM Lab services for the end-to-end tests: a token-authenticated Ray head and an MLflow
server (basic auth) started by infra/local/up.sh in a temporary CEMLAB_HOME, stopped by down.sh."""

import atexit
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import subprocess
import sys
import tempfile
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


# What the commands import (torch, Ray Train and Tune, MLflow, transformers), imported once:
# each command is a process forked from Python's forkserver, which imported these and nothing
# else (no thread, no OpenMP pool, no connection), instead of a fresh interpreter. A command
# is otherwise mostly its imports: `plan` took 4.2 core-seconds as a subprocess, 0.35 forked.
COMMAND_IMPORTS = ["orchestrator.cli", "orchestrator.execution.run",
                   "orchestrator.records.model_registry", "orchestrator.science.results",
                   "orchestrator.science.report", "orchestrator.planning.plan",
                   "orchestrator.planning.calibrate", "workloads.lm.workload",
                   "workloads.gp.workload", "transformers"]
_COMMANDS = multiprocessing.get_context("forkserver")
_forkserver_home: str | None = None  # the CEMLAB_HOME whose environment the forkserver has


def _forkserver_for(env: dict) -> None:
    """The forkserver, started in the environment of ``env``'s stack: Ray reads some of it
    as it is imported (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``, its C++ settings), so the one of
    another stack is stopped first. Several commands at once share the cores, so their OpenMP
    threads wait passively (spinning, the grid test's eight models commands took 55 s, 28 s
    passive): ``OMP_WAIT_POLICY``, which OpenMP reads once, as torch loads it."""
    global _forkserver_home
    if _forkserver_home == env["CEMLAB_HOME"]:
        return
    multiprocessing.forkserver._forkserver._stop()  # the stdlib's own (private) stop
    with pytest.MonkeyPatch.context() as mp:
        for name, value in {"OMP_WAIT_POLICY": "PASSIVE", **env}.items():
            mp.setenv(name, value)
        _COMMANDS.set_forkserver_preload(COMMAND_IMPORTS)
        multiprocessing.forkserver.ensure_running()
    _forkserver_home = env["CEMLAB_HOME"]


def _command(args: tuple[str, ...], env: dict, out: str, err: str) -> None:
    """In the forked process: what ``python -m orchestrator ARGS`` does in the repository with
    ``env``, its standard output and error (file descriptors 1 and 2) in the files ``out`` and
    ``err`` (one file if they are the same), and its exit handlers run at the end, as at an
    interpreter's exit."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(ROOT)
    os.dup2(os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 1)
    os.dup2(1 if err == out else os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 2)
    sys.argv = ["python -m orchestrator", *args]
    try:
        runpy.run_module("orchestrator", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code
    finally:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code)


class Command:
    """An ``orchestrator`` command started by ``start_orchestrator``, with what the tests use of
    ``subprocess.Popen``: ``pid``, ``poll``, ``wait``, ``send_signal``, ``kill`` and
    ``returncode`` (minus the signal's number if a signal ended it)."""

    def __init__(self, process: multiprocessing.process.BaseProcess, args: list[str]):
        self.process, self.args, self.pid = process, args, process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.process.exitcode

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def kill(self) -> None:
        self.process.kill()


def start_orchestrator(env: dict, *args: str, out: Path, err: Path | None = None) -> Command:
    """``python -m orchestrator ARGS`` against the stack of ``env``, started, its standard
    output in ``out`` and its error in ``err`` (default: ``out`` too): a process forked from the
    stack's forkserver (``COMMAND_IMPORTS``, ``_forkserver_for``)."""
    env = {"OMP_WAIT_POLICY": "PASSIVE", **env, "RAY_ADDRESS": env["CEMLAB_RAY_GCS_ADDRESS"]}
    _forkserver_for(env)
    process = _COMMANDS.Process(target=_command, args=(args, env, str(out), str(err or out)))
    process.start()
    return Command(process, ["orchestrator", *args])


def orchestrators(env: dict, *commands: tuple[str, ...],
                  timeout: int = 900) -> list[subprocess.CompletedProcess]:
    """``orchestrator`` of each of ``commands``, all at once (commands that need nothing of each
    other), each in a process of its own (``start_orchestrator``), their output captured."""
    with tempfile.TemporaryDirectory() as outputs:
        started = [start_orchestrator(env, *args, out=Path(outputs, f"{i}.out"),
                                      err=Path(outputs, f"{i}.err"))
                   for i, args in enumerate(commands)]
        deadline = time.monotonic() + timeout
        try:
            codes = [command.wait(max(1.0, deadline - time.monotonic())) for command in started]
        except subprocess.TimeoutExpired:
            for command in started:
                command.kill()
            raise
        return [subprocess.CompletedProcess(command.args, code,
                                            *(Path(outputs, f"{i}.{name}").read_text(
                                                errors="replace") for name in ("out", "err")))
                for i, (command, code) in enumerate(zip(started, codes))]


def write_spec(tmp_path: Path, spec: dict) -> Path:
    path = tmp_path / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path
