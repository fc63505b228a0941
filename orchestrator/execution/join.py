"""``cemlab join HEAD``: this host joins the Ray cluster whose head ``make up`` started
(``CEMLAB_BIND_ADDRESS`` set, so other hosts reach it).

    cemlab join 10.0.0.5:6380 --token-file ray_auth_token     # the head's GCS address, port
    cemlab join 10.0.0.5:6380 --num-gpus 8 --block            # in the foreground

What a node of the cluster needs, read here, each missing piece refused in one line before
anything starts: the head's address (``CEMLAB_RAY_GCS_ADDRESS`` in the head's
``services.env``), answering; the cluster's token (the head's ``$CEMLAB_HOME/ray_auth_token``,
copied here: ``--token-file``, or ``RAY_AUTH_TOKEN_PATH``); with an ``s3://`` storage root
(``CEMLAB_STORAGE``, as on the head) the S3 credentials of this host's environment
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``) and a bucket they reach. Then it starts the
Ray node with: this host's address towards the head (``--node-ip-address``: the one a
multi-homed host routes to the head by, unless given), Gloo pinned to the interface holding it
(``GLOO_SOCKET_IFNAME``, else Gloo resolves the hostname, often to loopback), token auth, and
a node-local ``CEMLAB_HOME`` (default ``$XDG_CACHE_HOME/cemlab``, ``~/.cache/cemlab``), where
the node's copy of a prepared corpus is cached once for every trial. The rest of the
environment (``MLFLOW_TRACKING_USERNAME``/``PASSWORD``, ``AWS_*``) passes on to the node's
workers.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

from workloads.core.reach import ServiceError
from workloads.core.storage import StorageRoot


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``cemlab join``."""
    parser.add_argument("head", help="the head's Ray address HOST:PORT (CEMLAB_RAY_GCS_ADDRESS "
                        "in its services.env)")
    parser.add_argument("--token-file", help="the cluster's token, a copy of the head's "
                        "$CEMLAB_HOME/ray_auth_token (default: RAY_AUTH_TOKEN_PATH)")
    parser.add_argument("--node-ip-address", help="this host's address the others reach "
                        "(default: the one it routes to the head by)")
    parser.add_argument("--home", help="this node's CEMLAB_HOME (default: CEMLAB_HOME, else "
                        "$XDG_CACHE_HOME/cemlab)")
    parser.add_argument("--num-cpus", type=int, help="CPUs for trials (default: all)")
    parser.add_argument("--num-gpus", type=int, help="GPUs for trials (default: all)")
    parser.add_argument("--object-store-memory", type=int, help="bytes (default: Ray's)")
    parser.add_argument("--block", action="store_true",
                        help="stay in the foreground until the node stops")


def head_address(head: str) -> tuple[str, int]:
    """``(host, port)`` of ``HOST:PORT``.

    Raises:
        ServiceError: not of that form.
    """
    host, _, port = head.rpartition(":")
    if not host or not port.isdigit():
        raise ServiceError(f"cemlab join: the head's address {head!r} is not HOST:PORT (its "
                           "services.env's CEMLAB_RAY_GCS_ADDRESS)")
    return host, int(port)


def reach_head(host: str, port: int, timeout_s: float = 5.0) -> str:
    """This host's address towards the head: the local end of a TCP connection to it.

    Raises:
        ServiceError: the head does not answer (one line).
    """
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s:
            return s.getsockname()[0]
    except OSError as e:
        raise ServiceError(f"cemlab join: the head {host}:{port} does not answer "
                           f"({e.strerror or e})") from None


def interface_of(address: str) -> str:
    """The network interface holding ``address``.

    Raises:
        ServiceError: no interface of this host holds it.
    """
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == address for a in addresses):
            return name
    raise ServiceError(f"cemlab join: no interface of this host holds {address} "
                       "(--node-ip-address)")


def token_path(given: str | None) -> Path:
    """The cluster's token file: ``given``, else ``RAY_AUTH_TOKEN_PATH``.

    Raises:
        ServiceError: none given, or not a readable, non-empty file.
    """
    path = given or os.environ.get("RAY_AUTH_TOKEN_PATH")
    if not path:
        raise ServiceError("cemlab join: no cluster token: copy the head's "
                           "$CEMLAB_HOME/ray_auth_token here and pass --token-file")
    try:
        if Path(path).read_text().strip():
            return Path(path).resolve()
    except OSError as e:
        raise ServiceError(f"cemlab join: the token file {path}: {e.strerror}") from None
    raise ServiceError(f"cemlab join: the token file {path} is empty")


def check_storage(env: dict[str, str]) -> None:
    """With an ``s3://`` storage root (``CEMLAB_STORAGE``), S3 credentials in ``env`` that
    reach its bucket (``CEMLAB_S3_ENDPOINT_URL``: another S3 API than AWS's).

    Raises:
        ServiceError: credentials missing, or the root unusable (one line).
    """
    uri = env.get("CEMLAB_STORAGE", "")
    if not uri.startswith("s3://"):
        return
    missing = [k for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY") if not env.get(k)]
    if missing:
        raise ServiceError(f"cemlab join: the storage root {uri} needs {' and '.join(missing)}"
                           " in this host's environment")
    StorageRoot(uri=uri, endpoint_url=env.get("CEMLAB_S3_ENDPOINT_URL")).check()


def node_environment(args: argparse.Namespace, node_ip: str) -> dict[str, str]:
    """The environment of this host's Ray node (and so of its workers)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cemlab"
    home = Path(args.home or os.environ.get("CEMLAB_HOME") or cache).resolve()
    return {**os.environ, "CEMLAB_HOME": str(home), "GLOO_SOCKET_IFNAME": interface_of(node_ip),
            "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path(args.token_file))}


def ray_start(args: argparse.Namespace, node_ip: str) -> list[str]:
    """The ``ray start`` command of this node."""
    ray = Path(sys.executable).parent / "ray"  # this environment's, beside its interpreter
    command = [str(ray) if ray.exists() else "ray", "start", f"--address={args.head}",
               f"--node-ip-address={node_ip}", "--disable-usage-stats"]
    for flag in ("num_cpus", "num_gpus", "object_store_memory"):
        if getattr(args, flag) is not None:
            command.append(f"--{flag.replace('_', '-')}={getattr(args, flag)}")
    return command + (["--block"] if args.block else [])


def join(args: argparse.Namespace) -> None:
    """Check what joining needs, then become the node (``exec`` of ``ray start``: this does
    not return).

    Raises:
        ServiceError: a piece is missing or does not answer (one line, before anything starts).
    """
    host, port = head_address(args.head)
    node_ip = args.node_ip_address or reach_head(host, port)
    if args.node_ip_address:
        reach_head(host, port)
    env = node_environment(args, node_ip)
    check_storage(env)
    Path(env["CEMLAB_HOME"]).mkdir(parents=True, exist_ok=True)
    command = ray_start(args, node_ip)
    print(f"[cemlab] joining {args.head} as {node_ip} ({env['GLOO_SOCKET_IFNAME']}), "
          f"CEMLAB_HOME {env['CEMLAB_HOME']}", flush=True)
    os.execvpe(command[0], command, env)
