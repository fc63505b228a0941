"""Two hosts on one Linux machine, sharing nothing but a network: the cluster rehearsal.

Host A is this machine's own network namespace with one end of a veth pair (``10.231.N.1``); it
runs the S3 API server (moto), the MLflow server (PostgreSQL backend store, artifacts proxied to
S3) and the Ray head (token auth), all bound to that address by ``infra/local/up.sh``. Host B is
a network namespace holding the other end (``10.231.N.2``) and, for each start of its Ray node,
a mount namespace of its own: private tmpfs over ``/tmp`` (Ray's temp dir is under it), over
``/dev/shm`` (the object store) and over A's ``CEMLAB_HOME``, so that B sees none of A's state;
only the code (the checkout and its virtualenv) is the same, as on nodes built from one image.
B's environment is built from nothing: the storage root and its S3 credentials, as on the head;
no setting of A's (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` above all) reaches it. B joins with the
documented command alone, ``cemlab join HEAD --token-file ...`` (the head's token copied to B),
which finds B's address, its Gloo interface and a node-local ``CEMLAB_HOME`` itself.

Needs root (``ip netns``, ``unshare -m``, ``mount``). ``TwoHosts`` removes exactly the
namespace, link, processes and directories it created, even when a step fails. Used by
``tests/infra/test_two_hosts.py`` (``make cluster-test``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from infra.local.services_env import read_services_env

ROOT = Path(__file__).resolve().parents[2]


B_HOME = "/tmp/home-b"  # host B's $HOME, on its private /tmp
B_TOKEN = f"{B_HOME}/ray_auth_token"  # the head's token, copied to host B

class HarnessError(RuntimeError):
    """The rehearsal cannot run here; ``str()`` is one line."""


def missing_requirement() -> str | None:
    """Why the rehearsal cannot run on this machine, or None."""
    if os.geteuid() != 0:
        return "the two-host rehearsal needs root (network and mount namespaces)"
    for tool in ("ip", "unshare", "nsenter", "mount"):
        if shutil.which(tool) is None:
            return f"the two-host rehearsal needs `{tool}` (iproute2/util-linux)"
    return None


def _run(*cmd: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=60, **kw)


def _free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def _wait(what: str, ready, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise HarnessError(f"{what} not ready within {timeout_s:.0f} s")
        time.sleep(1)


class TwoHosts:
    """``with TwoHosts(workdir, backend_uri) as hosts:`` host A's services and host B's Ray node.

    ``workdir``: a new directory for A's ``CEMLAB_HOME`` and logs. ``backend_uri``: MLflow's
    backend store (and the ledger), a PostgreSQL database reachable from host A.
    Attributes once entered: ``a``/``b`` (addresses), ``env`` (host A's environment for
    ``ray job submit`` and the orchestrator), ``storage`` (the ``s3://`` root),
    ``s3_endpoint``.
    """

    def __init__(self, workdir: Path, backend_uri: str) -> None:
        self.workdir = Path(workdir)
        self.backend_uri = backend_uri
        n = 20 + os.getpid() % 200  # one subnet and link name per harness process
        self.netns, self.veth_a, self.veth_b = f"cemlab-b{n}", f"cla{n}", f"clb{n}"
        self.a, self.b = f"10.231.{n}.1", f"10.231.{n}.2"
        self.home = self.workdir / "home"  # CEMLAB_HOME of both hosts: same path, own content
        self._cleanup: list = []
        self._b_proc: subprocess.Popen | None = None

    # -- lifecycle -----------------------------------------------------------------------
    def __enter__(self) -> TwoHosts:
        reason = missing_requirement()
        if reason:
            raise HarnessError(reason)
        try:
            self._network()
            self._s3()
            self._host_a()
            self.start_b()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        errors = []
        for undo in reversed(self._cleanup):
            try:
                undo()
            except Exception as e:  # keep undoing the rest
                errors.append(f"{undo.__name__}: {e}")
        self._cleanup.clear()
        if errors and exc[0] is None:
            raise HarnessError("cleanup failed: " + "; ".join(errors))

    def _network(self) -> None:
        _run("ip", "netns", "add", self.netns)
        self._cleanup.append(self._delete_netns)
        _run("ip", "link", "add", self.veth_a, "type", "veth", "peer", "name", self.veth_b)
        self._cleanup.append(self._delete_link)
        _run("ip", "link", "set", self.veth_b, "netns", self.netns)
        _run("ip", "addr", "add", f"{self.a}/24", "dev", self.veth_a)
        _run("ip", "link", "set", self.veth_a, "up")
        for cmd in (("ip", "addr", "add", f"{self.b}/24", "dev", self.veth_b),
                    ("ip", "link", "set", self.veth_b, "up"), ("ip", "link", "set", "lo", "up")):
            _run("ip", "netns", "exec", self.netns, *cmd)

    def _delete_netns(self) -> None:
        _run("ip", "netns", "del", self.netns)

    def _delete_link(self) -> None:  # gone with the namespace unless that step failed
        if subprocess.run(["ip", "link", "show", self.veth_a], capture_output=True).returncode == 0:
            _run("ip", "link", "del", self.veth_a)

    def _s3(self) -> None:
        import boto3

        self.workdir.mkdir(parents=True, exist_ok=True)
        port = _free_port(self.a)
        self.s3_endpoint = f"http://{self.a}:{port}"
        self.s3_env = {"AWS_ACCESS_KEY_ID": "cemlab-rehearsal",
                       "AWS_SECRET_ACCESS_KEY": "cemlab-rehearsal",
                       "AWS_DEFAULT_REGION": "us-east-1"}
        log = open(self.workdir / "s3.log", "w")  # noqa: SIM115 (lives as long as the server)
        proc = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-H", self.a,
                                 "-p", str(port)], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self._cleanup.append(lambda: (os.killpg(proc.pid, signal.SIGKILL), proc.wait(),
                                      log.close()))
        s3 = boto3.client("s3", endpoint_url=self.s3_endpoint,
                          aws_access_key_id=self.s3_env["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=self.s3_env["AWS_SECRET_ACCESS_KEY"],
                          region_name=self.s3_env["AWS_DEFAULT_REGION"])

        def answers() -> bool:
            try:
                s3.list_buckets()
                return True
            except Exception:
                return False

        _wait("the S3 server", answers, 60)
        s3.create_bucket(Bucket="cemlab")
        self.storage = "s3://cemlab/lab"

    def _host_a(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "host-a-marker").write_text("host A's CEMLAB_HOME\n")
        base = {k: v for k, v in os.environ.items()
                if not k.startswith(("RAY_", "CEMLAB_", "MLFLOW_", "AWS_"))}
        env = {**base, **self.s3_env, "CEMLAB_HOME": str(self.home),
               "VENV_BIN": str(Path(sys.executable).parent), "CEMLAB_BIND_ADDRESS": self.a,
               "CEMLAB_STORAGE": self.storage, "CEMLAB_S3_ENDPOINT_URL": self.s3_endpoint,
               "CEMLAB_MLFLOW_BACKEND_URI": self.backend_uri, "CEMLAB_RAY_CPUS": "2",
               "CEMLAB_RAY_PORT": "0", "CEMLAB_RAY_DASHBOARD_PORT": "0",
               "CEMLAB_MLFLOW_PORT": "0"}
        self._cleanup.append(lambda: subprocess.run([str(ROOT / "infra/local/down.sh")],
                                                    env=env, timeout=120, capture_output=True))
        up = subprocess.run([str(ROOT / "infra/local/up.sh")], env=env, capture_output=True,
                            text=True, timeout=300)
        if up.returncode:
            raise HarnessError(f"host A's services did not start: {up.stderr.strip()[-500:]}")
        self.env = {**env, **read_services_env(self.home / "services.env")}
        self.env["RAY_ADDRESS"] = self.env["CEMLAB_RAY_GCS_ADDRESS"]
        self.token = (self.home / "ray_auth_token").read_text().strip()

    # -- host B ----------------------------------------------------------------------------
    def start_b(self) -> None:
        """Start host B's Ray node (fresh private filesystems) and wait until the head sees
        both nodes."""
        venv = Path(sys.executable).parent.parent
        under_tmp = sorted(str(p) for p in {ROOT, venv} if str(p).startswith("/tmp/"))
        keep = [p for p in under_tmp if not any(p.startswith(q + "/") for q in under_tmp)]
        stash = Path(tempfile.mkdtemp(prefix="cemlab-b-stash-", dir="/run"))
        self._cleanup.append(lambda: shutil.rmtree(stash, ignore_errors=True))
        script = "\n".join([
            "set -euo pipefail",
            # The code (checkout, virtualenv) stays visible where it is, as on an image.
            *[f"mkdir -p {stash}/{i} && mount --rbind {p} {stash}/{i}"
              for i, p in enumerate(keep)],
            "mount -t tmpfs cemlab-b-tmp /tmp",
            "mount -t tmpfs cemlab-b-shm /dev/shm",
            *[f"mkdir -p {p} && mount --move {stash}/{i} {p}" for i, p in enumerate(keep)],
            f"mkdir -p {self.home} && mount -t tmpfs cemlab-b-home {self.home}",
            # The token copied from the head, then the one documented command.
            f'mkdir -p "$HOME" && (umask 077 && printf %s "$CEMLAB_B_TOKEN" > {B_TOKEN}) '
            "&& unset CEMLAB_B_TOKEN",
            f"exec cemlab join {self.env['CEMLAB_RAY_GCS_ADDRESS']} --token-file {B_TOKEN} "
            f"--num-cpus 1 --object-store-memory {2**29} --block",
        ])
        # Host B's environment: the storage root and its S3 credentials, as on the head, and
        # nothing else of the cluster's: the join finds B's address, its Gloo interface and a
        # node-local CEMLAB_HOME (under $HOME/.cache) itself.
        env = {"PATH": f"{venv}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
               "HOME": B_HOME, "LANG": "C.UTF-8", **self.s3_env,
               "CEMLAB_STORAGE": self.storage, "CEMLAB_S3_ENDPOINT_URL": self.s3_endpoint,
               "CEMLAB_B_TOKEN": self.token, "PYTHONUNBUFFERED": "1"}
        log = open(self.workdir / "host-b.log", "a")  # noqa: SIM115
        self._b_proc = subprocess.Popen(
            ["ip", "netns", "exec", self.netns, "unshare", "-m", "--propagation", "private",
             "bash", "-c", script], env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
        log.close()
        if self.kill_b not in self._cleanup:
            self._cleanup.append(self.kill_b)
        _wait("host B's Ray node", lambda: len(self.alive_nodes()) == 2, 180)

    def kill_b(self) -> None:
        """SIGKILL every process of host B (all of its network namespace)."""
        pids = subprocess.run(["ip", "netns", "pids", self.netns], capture_output=True,
                              text=True).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self._b_proc is not None:
            self._b_proc.wait(timeout=30)

    def b_raylet_pid(self) -> int:
        """PID of a process of host B's Ray node (to enter its namespaces)."""
        out = subprocess.run(["ip", "netns", "pids", self.netns], capture_output=True,
                             text=True).stdout.split()
        for pid in out:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            if b"raylet" in cmdline:
                return int(pid)
        raise HarnessError("host B runs no raylet")

    def on_b(self, *cmd: str) -> subprocess.CompletedProcess:
        """Run ``cmd`` inside host B's network and mount namespaces."""
        return subprocess.run(["nsenter", "-t", str(self.b_raylet_pid()), "-m", "-n", *cmd],
                              capture_output=True, text=True, timeout=60)

    def alive_nodes(self) -> list[dict]:
        """The head's view: ``[{"id", "ip"}]`` of alive nodes."""
        probe = subprocess.run(
            [sys.executable, "-c", "import json, ray; ray.init(address='auto', "
             "logging_level='ERROR'); print(json.dumps([{'id': n['NodeID'], 'ip': "
             "n['NodeManagerAddress']} for n in ray.nodes() if n['Alive']]))"],
            env=self.env, capture_output=True, text=True, timeout=60)
        if probe.returncode:
            return []
        return json.loads(probe.stdout.strip().splitlines()[-1])

    def submit(self, spec: Path, **env_vars: str) -> subprocess.Popen:
        """``ray job submit`` of ``orchestrator run --no-cache spec`` from host A (the rehearsal
        trains one trial under several placements, each in an experiment of its own: none may
        be copied from another), with ``env_vars`` over the head's environment for the job
        (returns at once)."""
        runtime_env = ["--runtime-env-json", json.dumps({"env_vars": env_vars})] if env_vars else []
        return subprocess.Popen(
            ["ray", "job", "submit", "--working-dir", ".", *runtime_env, "--", "python", "-m",
             "orchestrator", "run", "--no-cache", str(spec)], cwd=ROOT, env=self.env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

