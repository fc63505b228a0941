"""What a trial's result depends on besides its config: the code that computes it, and the
commit it ran on.

``code_fingerprint`` hashes the syntax trees (docstrings and comments left out) of the modules that
compute results: the models and their config, the data pipeline, the optimizer, the engine, the
precision and the workloads' train loops. It is part of every trial's id, so a change to that code
never silently reuses an old trial, while a docstring or comment edit does not invalidate any.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import os
import subprocess
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]  # the workloads package
SCIENCE = ("models", "lm/data", "lm/workload.py", "gp", "core/architecture.py", "core/config.py",
           "core/precision.py", "runtime/engine.py", "runtime/optim.py")
NOT_SCIENCE = ("lm/data/corpus_bench.py",)  # measures, computes nothing a trial uses


def _without_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return tree


def fingerprint_sources(root: Path, members: tuple[str, ...] = SCIENCE,
                        excluded: tuple[str, ...] = NOT_SCIENCE) -> str:
    """sha256 (16 hex digits) over each Python file of ``members`` under ``root`` (files, or
    directories searched recursively), in path order: its relative path and its syntax tree
    without docstrings (``ast.dump``; comments and formatting never reach the tree).

    Raises:
        SyntaxError: a file that does not parse.
    """
    files = sorted(p for m in members for p in (
        [root / m] if m.endswith(".py") else (root / m).rglob("*.py"))
        if p.relative_to(root).as_posix() not in excluded)
    h = hashlib.sha256()
    for path in files:
        tree = _without_docstrings(ast.parse(path.read_text(encoding="utf-8")))
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(ast.dump(tree).encode() + b"\0")
    return h.hexdigest()[:16]


@functools.cache
def code_fingerprint() -> str:
    """``fingerprint_sources`` of this installed ``workloads`` package (computed once)."""
    return fingerprint_sources(PACKAGE)


def git_commit() -> str | None:
    """The commit of the checkout this code runs from (``-dirty`` when it has uncommitted
    changes), or ``CEMLAB_GIT_COMMIT`` (set where the code travels without ``.git``, e.g. a
    container image), or None."""
    try:
        run = functools.partial(subprocess.run, cwd=PACKAGE, capture_output=True, text=True,
                                timeout=10)
        head = run(["git", "rev-parse", "HEAD"])
        if head.returncode == 0:
            dirty = run(["git", "status", "--porcelain", "--untracked-files=no"]).stdout.strip()
            return head.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        pass
    return os.environ.get("CEMLAB_GIT_COMMIT") or None
