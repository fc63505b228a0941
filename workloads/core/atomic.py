"""Atomic writes: a file or directory is complete at its final path, or absent."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A fresh temporary path beside ``path`` (same directory, so the same filesystem) for the
    block to write a file or a directory to; renamed onto ``path`` (``os.replace``) when the block
    ends without an exception, removed when it raises. The parent directory is created.

    Raises:
        OSError: ``path`` is an existing non-empty directory (a directory is never replaced).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()
