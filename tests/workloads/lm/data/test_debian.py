"""The Debian English corpus: pinned packages fetched from Debian's pool and verified, read as
plain English documents, the same every time."""

import dataclasses
import hashlib
import re
from collections import Counter

import pytest

from workloads.lm.data import CorpusConfig, DebianEnglishSource, debian, documents

pytestmark = pytest.mark.slow  # 34 MB from Debian's pool, and 11 s a read of every package


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return DebianEnglishSource(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def docs(source):
    return [(d.doc_id, d.text) for d in documents(source)]


def test_every_package_is_fetched_once_and_matches_its_pin(source):
    assert [p.name for p in source.debs] == [p.path.rsplit("/", 1)[1]
                                             for p in debian.PACKAGES.values()]
    for path, pkg in zip(source.debs, debian.PACKAGES.values(), strict=True):
        assert hashlib.sha256(path.read_bytes()).hexdigest() == pkg.sha256
    mtimes = [p.stat().st_mtime_ns for p in source.debs]
    assert [p.stat().st_mtime_ns for p in DebianEnglishSource(source.cache_dir.parent).debs] \
        == mtimes  # the second source downloads nothing


def test_the_corpus_is_over_ten_million_words_of_plain_text_in_unique_documents(docs):
    ids = [doc_id for doc_id, _ in docs]
    assert len(ids) == len(set(ids)) > 4000
    per_package = Counter(doc_id.split("/")[0] for doc_id in ids)
    assert set(per_package) == {"gcide", "anarchism", "tdavid", "mhcc", "web", "austen"}
    assert sum(len(text.split()) for _, text in docs) > 10_000_000
    assert max(len(text) for _, text in docs) <= debian.MAX_DOC_CHARS
    # No markup left: tags, entities (not Austen's "&c;"), GCIDE's accent codes, link targets.
    markup = re.compile(r"<[a-zA-Z/][^>]*>|&(?:[a-z]{2,8}|#\d+);|\[[`'^\"~]\w\]|\]\(http")
    for doc_id, text in docs:
        assert not markup.search(text), doc_id


def test_documents_hold_the_texts_their_ids_name(docs):
    text = dict(docs)
    assert text["austen/prideprejudice/01"].startswith(
        "It is a truth universally acknowledged, that a single man in possession of a good "
        "fortune, must be in want of a wife.")
    assert "Yahweh is my shepherd;\nI shall lack nothing." in text["web/Ps.23"]
    assert "In the beginning, God created the heavens and the earth." in text["web/Gen.1"]
    assert '"The Lord is my shepherd."' in text["tdavid/Ps.23/00"]
    assert any(t.startswith("Froth, n.") or "\n\nFroth, n." in t
               for d, t in docs if d.startswith("gcide/"))


def test_two_reads_give_the_same_documents(source, docs):
    again = [(d.doc_id, d.text) for d in documents(source)]
    assert again == docs


def test_a_package_whose_bytes_are_not_the_pinned_ones_is_one_line_and_leaves_nothing(
        tmp_path, monkeypatch):
    pkg = debian.PACKAGES["r-cran-janeaustenr"]
    monkeypatch.setitem(debian.PACKAGES, pkg.name, dataclasses.replace(pkg, sha256="0" * 64))
    with pytest.raises(debian.FetchError, match=r"^r-cran-janeaustenr: sha256 of http\S+ is "
                       r"[0-9a-f]{64}, pinned 0{64}$"):
        debian.fetch(pkg.name, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_spec_names_the_corpus_as_debian_english():
    assert CorpusConfig(source="debian_english").source == "debian_english"
    with pytest.raises(ValueError, match="debian_english"):
        CorpusConfig(source="debian")
