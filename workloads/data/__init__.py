"""Text sources, the BPE tokenizer, splits and packed sequences."""

from workloads.data.corpus import CorpusConfig, PreparedCorpus, prepare_corpus
from workloads.data.packing import PackedSequences
from workloads.data.sources import Document, ShakespeareSource, TextFilesSource, split_documents

__all__ = ["CorpusConfig", "Document", "PackedSequences", "PreparedCorpus", "ShakespeareSource",
           "TextFilesSource", "prepare_corpus", "split_documents"]
