"""The documentation: the MkDocs site builds with every link and anchor resolved, the README
stays a user's page, and nothing in the project narrates how it was built."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NARRATION = re.compile(r"\blent\b|\bissue \d|\btried\b", re.IGNORECASE)


def test_the_site_builds_strictly(tmp_path):
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d",
                          str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "site" / "architecture" / "index.html").is_file()


def test_the_readme_is_a_users_page():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


def test_no_file_narrates_how_the_project_was_built():
    """Docs, docstrings and comments speak of the project, not of the work on it: no borrowed
    machines, issue numbers or "tried" stories (generated reports under docs/results aside)."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    found = []
    for name in files:
        path = ROOT / name
        if name.startswith("docs/results/") or path.suffix not in {
                ".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".cfg", ".txt", ""}:
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, IsADirectoryError, FileNotFoundError):
            continue
        found += [f"{name}:{i}: {line.strip()}" for i, line in enumerate(text.splitlines(), 1)
                  if NARRATION.search(line) and name != "tests/test_docs.py"]
    assert not found, "\n".join(found[:40])


def test_commands_shown_to_users_are_cemlab_commands():
    """What a user reads (the dashboard, the docs and reports, CLI messages, model cards) names
    the installed command, ``cemlab run ...``, not ``python -m orchestrator run ...``; modules
    with a main of their own (``python -m orchestrator.bench``) are not ``cemlab`` commands."""
    module_form = re.compile(r"python -m orchestrator [a-z]")
    files = subprocess.run(["git", "ls-files", "README.md", "dashboards", "docs", "orchestrator",
                            "workloads", "infra", "experiments"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    found = [f"{name}:{i}: {line.strip()}" for name in files if (ROOT / name).is_file()
             and (ROOT / name).suffix in {".py", ".md", ".yaml", ".yml", ".sh", ""}
             for i, line in enumerate((ROOT / name).read_text(errors="replace").splitlines(), 1)
             if module_form.search(line)]
    assert not found, "\n".join(found)
