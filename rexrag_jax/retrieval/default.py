"""One-call retriever for demos: MiniLM (offline package weights) + exact search over a small corpus."""
from __future__ import annotations

from rexrag_jax.io import paths
from rexrag_jax.retrieval.index import Index, IndexLoadError, build_index
from rexrag_jax.retrieval.retriever import LocalRetriever


def build_default_retriever(corpus_path: str, index_dir: str, *, encoder=None, progress: bool = False,
                            searcher: str = "auto") -> LocalRetriever:
    """Load `index_dir` if it was built from this exact corpus with this encoder, else (re)build it.
    `index_dir` (and `corpus_path`) may be gs:// URLs (rexrag_jax.retrieval.index stages them locally)."""
    if encoder is None:
        from rexrag_jax.retrieval.encoder import minilm_encoder

        encoder = minilm_encoder()
    if paths.isfile(paths.join(index_dir, "manifest.json")):
        try:
            return LocalRetriever(Index.load(index_dir, encoder=encoder, corpus_path=corpus_path), encoder)
        except IndexLoadError as e:
            if progress:
                print(f"rebuilding index: {e}")
    build_index(corpus_path, index_dir, encoder, searcher=searcher, progress=progress)
    return LocalRetriever(Index.load(index_dir, encoder=encoder), encoder)
