"""Shared fixtures: small real corpora written to disk."""

import random
from pathlib import Path

import pytest

WORDS = ("the king queen crown sword night day love death honour speak hear thou thee my lord "
         "lady fair foul sweet bitter cold warm house field river stone ship sea").split()


def write_corpus(directory: Path, n_docs: int = 12, words_per_doc: int = 4000,
                 seed: int = 0) -> str:
    """``n_docs`` text files of pseudo-English (a skewed word distribution); returns a glob."""
    rng = random.Random(seed)
    weights = [1 / (rank + 1) for rank in range(len(WORDS))]
    directory.mkdir(parents=True, exist_ok=True)
    for d in range(n_docs):
        lines = []
        for _ in range(words_per_doc // 10):
            lines.append(" ".join(rng.choices(WORDS, weights, k=10)) + ".")
        (directory / f"doc{d:02d}.txt").write_text("\n".join(lines) + "\n")
    return str(directory / "*.txt")


@pytest.fixture
def corpus_glob(tmp_path: Path) -> str:
    return write_corpus(tmp_path / "corpus")
