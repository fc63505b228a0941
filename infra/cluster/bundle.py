"""Prepare the directory that the launcher YAMLs (infra/cluster/*.yaml) copy to every node.

    python infra/cluster/bundle.py            # ~/.cemlab-cluster, or $CEMLAB_CLUSTER_DIR
    ray up infra/cluster/aws-a100.yaml

The directory (``file_mounts``: ``/home/ray/.cemlab-cluster`` on the nodes) holds

- ``auth_token``: the cluster's Ray token, generated once (64 hex characters, mode 0600) and
  kept across runs; clients use it with ``RAY_AUTH_TOKEN_PATH`` (docs/deploy.md). It is this
  cluster's own token, apart from the local one in ``~/.ray/auth_token``.
- ``cemlab.env``: the nodes' settings (``infra/cluster/cemlab.env.example`` on the first run,
  to be edited). Rejected while it still holds placeholders or a required key is empty, or when
  an address in it resolves, here, to a loopback address.
- ``cemlab/``: this checkout as git sees it (tracked and untracked files, minus ignored ones:
  no ``.venv``, no ``.cemlab``), replaced on every run; the nodes ``pip install -e`` it.

Returns 0 when the directory is ready for ``ray up``, 1 with the reason on stderr otherwise.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import secrets
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "infra" / "cluster" / "cemlab.env.example"
REQUIRED = ("CEMLAB_STORAGE", "MLFLOW_TRACKING_URI", "CEMLAB_LEDGER_URL")
PLACEHOLDERS = ("CHANGE-ME", "your-bucket", "example.com")
ADDRESSES = ("MLFLOW_TRACKING_URI", "CEMLAB_LEDGER_URL")


def read_env(path: Path) -> dict[str, str]:
    """``KEY=value`` lines of ``path`` (comments and blank lines skipped, quotes stripped)."""
    values = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, value = line.split("=", 1)
        values[key.strip()] = value.strip().strip("'\"")
    return values


def _loopback(host: str) -> bool:
    """Whether ``host`` resolves, on this machine, to a loopback address (unresolvable names,
    e.g. a VPC's internal ones, are the nodes' business: node-env.sh checks there)."""
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return any(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def env_problems(values: dict[str, str]) -> list[str]:
    """What keeps ``cemlab.env``'s ``values`` from working on a multi-node cluster."""
    problems = [f"{key} is not set" for key in REQUIRED if not values.get(key)]
    problems += [f"{key} still holds a placeholder ({values[key]})" for key in values
                 if any(p in values[key] for p in PLACEHOLDERS)]
    for key in ADDRESSES:
        host = urlsplit(values.get(key, "")).hostname
        if host and _loopback(host):
            problems.append(f"{key}: {host} is a loopback address, unreachable from the nodes")
    if values.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"):
        problems.append("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER is a local-only setting")
    return problems


def export_checkout(target: Path) -> int:
    """Copy the files of this checkout that git does not ignore into ``target`` (replaced);
    the number of files."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO, check=True, capture_output=True).stdout
    if target.exists():
        shutil.rmtree(target)
    count = 0
    for name in sorted({n for n in listed.decode().split("\0") if n}):
        source = REPO / name
        if not source.is_file():  # deleted in the working tree, still in the index
            continue
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target / name)
        count += 1
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path(
        os.environ.get("CEMLAB_CLUSTER_DIR", "~/.cemlab-cluster")).expanduser())
    directory = parser.parse_args(argv).dir.expanduser()
    directory.mkdir(parents=True, exist_ok=True)

    token = directory / "auth_token"
    if not token.exists():
        token.touch(mode=0o600)
        token.write_text(secrets.token_hex(32) + "\n")
        print(f"generated a Ray token: {token}")

    env = directory / "cemlab.env"
    if not env.exists():
        shutil.copyfile(EXAMPLE, env)
        env.chmod(0o600)
        print(f"error: fill in {env} (created from {EXAMPLE.name}), then run again",
              file=sys.stderr)
        return 1
    problems = env_problems(read_env(env))
    for problem in problems:
        print(f"error: {env}: {problem}", file=sys.stderr)
    if problems:
        return 1

    count = export_checkout(directory / "cemlab")
    print(f"{directory} ready for `ray up`: auth_token, cemlab.env, cemlab/ ({count} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
