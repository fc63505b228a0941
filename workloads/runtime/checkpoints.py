"""Checkpoint integrity: a manifest per rank, written last, and a restore that only trusts what
verifies.

Every rank writes its part of a checkpoint into a directory of its own, then
``write_manifest`` adds ``manifest-rank<r>.json`` (the sha256 of each of its files, its rank,
the world size and the step), atomically and last: a rank's part without its manifest was cut
short. Ray Train merges the ranks' directories into one checkpoint; ``problem`` checks that it
has the manifest of every rank and that every listed file is there with its digest.
``newest_good`` walks checkpoints newest first and returns the first that verifies, saying in
one line why each newer one was passed over. DeepSpeed's ``latest`` file is never read: the
engines load an explicit tag.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TypeVar

from workloads.core.atomic import atomic_path

log = logging.getLogger(__name__)

_MANIFEST = "manifest-rank{rank}.json"
_CHUNK = 2**20
T = TypeVar("T")


def sha256_of(path: str | os.PathLike) -> str:
    """Hex sha256 of the file at ``path``, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files(directory: Path) -> list[str]:
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*")
                  if p.is_file() and not p.name.startswith("manifest-rank"))


def write_manifest(directory: str | os.PathLike, rank: int, world_size: int, step: int) -> Path:
    """Write ``manifest-rank<rank>.json`` into ``directory``: the sha256 of every file this rank
    wrote there (all of it but manifests), atomically (temporary file, then rename), last.
    Returns its path."""
    directory = Path(directory)
    manifest = {"rank": rank, "world_size": world_size, "step": step,
                "files": {f: sha256_of(directory / f) for f in _files(directory)}}
    path = directory / _MANIFEST.format(rank=rank)
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return path


def problem(directory: str | os.PathLike) -> str | None:
    """Why the merged checkpoint in ``directory`` cannot be trusted, in a few words, or None:
    no manifest (a save cut short), a rank's manifest missing, a listed file missing, or a file
    whose sha256 differs from its manifest's (corrupt)."""
    directory = Path(directory)
    manifests = sorted(directory.glob("manifest-rank*.json"))
    if not manifests:
        return "no manifest (the save was cut short, or it predates manifests)"
    try:
        parts = [json.loads(m.read_text()) for m in manifests]
        world_size = parts[0]["world_size"]
        ranks = {p["rank"] for p in parts}
        files = {f: digest for p in parts for f, digest in p["files"].items()}
    except (ValueError, KeyError, TypeError) as e:
        return f"unreadable manifest ({type(e).__name__}: {e})"
    if ranks != set(range(world_size)):
        return f"manifests of ranks {sorted(ranks)} only, of a world of {world_size}"
    for name, digest in sorted(files.items()):
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if sha256_of(path) != digest:
            return f"{name} is corrupt (sha256 differs from its manifest)"
    return None


def newest_good(candidates: Iterable[T], open_dir: Callable[[T], AbstractContextManager[str]],
                load: Callable[[str], int]) -> tuple[T, int] | None:
    """The first of ``candidates`` (newest first) whose directory (``open_dir``) verifies
    (``problem``), loaded with ``load(directory) -> step``: ``(candidate, step)``; None when
    there are no candidates.

    Raises:
        RuntimeError: every candidate is unusable (one line naming each): a trial never starts
            fresh over checkpoints it cannot trust.
    """
    rejected = []
    for candidate in candidates:
        with open_dir(candidate) as d:
            why = problem(d)
            if why is None:
                if rejected:
                    log.warning("[train] restoring from %s: newer checkpoint(s) unusable: %s",
                                candidate, "; ".join(rejected))
                return candidate, load(d)
        log.warning("[train] checkpoint %s is unusable: %s; trying the previous one",
                    candidate, why)
        rejected.append(f"{candidate}: {why}")
    if rejected:
        raise RuntimeError("no usable checkpoint, not starting over: " + "; ".join(rejected))
    return None
