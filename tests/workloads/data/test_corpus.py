"""Corpus preparation: config validation, tokenizer on the train split only, token streams,
cache, unigram floor."""

import math
import os
from collections import Counter

import numpy as np
import pytest
from tokenizers import Tokenizer

from workloads.data import CorpusConfig, TextFilesSource, prepare_corpus, split_documents
from workloads.data.packing import read_token_stream


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
