"""Read the ``services.env`` that ``infra/local/up.sh`` writes, as a dict (for Python callers:
the tests and the two-host rehearsal)."""

from __future__ import annotations

import os
from pathlib import Path


def read_services_env(path: Path) -> dict[str, str]:
    """The ``export KEY="value"`` lines of ``path``, ``$PATH`` expanded to this process's."""
    env = {}
    for line in Path(path).read_text().splitlines():
        if line.startswith("export "):
            key, _, value = line[len("export "):].partition("=")
            env[key] = value.strip('"').replace("$PATH", os.environ.get("PATH", ""))
    return env
