"""Retrieval: corpus reader, BERT encoder batching, exact/ScaNN index, POST /retrieve server + clients."""
from rexrag_jax.retrieval.corpus import CorpusError, Passage, iter_corpus, read_corpus
from rexrag_jax.retrieval.default import build_default_retriever
from rexrag_jax.retrieval.format import format_passages
from rexrag_jax.retrieval.index import Index, IndexLoadError, build_index
from rexrag_jax.retrieval.retriever import HttpRetriever, LocalRetriever, Retriever

__all__ = ["CorpusError", "HttpRetriever", "Index", "IndexLoadError", "LocalRetriever", "Passage", "Retriever",
           "build_default_retriever", "build_index", "format_passages", "iter_corpus", "read_corpus"]
