"""Text sources, the BPE tokenizer, splits, the Ray Data corpus pipeline and packed sequences."""

from workloads.lm.data.corpus import CorpusConfig, PreparedCorpus, prepare_corpus
from workloads.lm.data.packing import PackedSequences
from workloads.lm.data.sources import (
    DebianEnglishSource,
    Document,
    ShakespeareSource,
    SlimPajamaSource,
    TextFilesSource,
    documents,
    split_documents,
)

__all__ = ["CorpusConfig", "DebianEnglishSource", "Document", "PackedSequences",
           "PreparedCorpus", "ShakespeareSource", "SlimPajamaSource", "TextFilesSource",
           "documents", "prepare_corpus", "split_documents"]
