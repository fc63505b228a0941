"""Provenance: the science code's fingerprint ignores docstrings and comments, not code; the
commit of the checkout."""

import re
import shutil

from workloads.core.provenance import PACKAGE, code_fingerprint, fingerprint_sources, git_commit


def test_the_fingerprint_sees_code_changes_not_docstrings_or_comments(tmp_path):
    copy = tmp_path / "workloads"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert fingerprint_sources(copy) == code_fingerprint()
    energy = copy / "models" / "energy.py"
    source = energy.read_text()

    energy.write_text(source.replace('"""The CEM energies', '"""The energies, reworded,')
                      .replace("# x <= 0:", "# for x <= 0:"))
    assert fingerprint_sources(copy) == code_fingerprint()  # words only
    (copy / "lm" / "data" / "corpus_bench.py").write_text("x = 1\n")
    assert fingerprint_sources(copy) == code_fingerprint()  # not science
    energy.write_text(source.replace("_TAYLOR_BELOW = 0.5", "_TAYLOR_BELOW = 0.25"))
    assert fingerprint_sources(copy) != code_fingerprint()  # a number that computes


def test_the_commit_is_the_checkouts():
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", git_commit())
