"""`rexrag build-index`, `rexrag merge-index`, `rexrag serve-retriever`, configured with gin (gin/retriever/).

    rexrag build-index --gin_file gin/retriever/minilm_exact.gin \
        --gin_bindings 'retrieval.build.corpus_path = "corpus.jsonl"' --gin_bindings 'retrieval.build.index_dir = "idx"'
    rexrag merge-index --parts idx.part0 idx.part1 --index_dir idx --gin_file gin/retriever/e5_scann.gin
    rexrag serve-retriever --index_dir idx --port 8000

`--corpus` / `--index_dir` are shorthands for those bindings. An interrupted build-index resumes (same
corpus, encoder and shard size); a finished index at --index_dir, or an interrupted build with other
settings, is refused (one line, exit 2) unless --overwrite, which builds from scratch and swaps the new
index in whole. merge-index refuses a finished output the same way (an interrupted merge starts over:
it is a copy). A non-empty directory that is not an index is never replaced. The resolved config is saved as
`index_dir/config.gin`; serve-retriever reads it first (so the query encoder matches the index),
then the given gin files and bindings.

Index dirs (and the corpus / part files) may be gs:// URLs (rexrag_jax.io.paths; rexrag_jax.retrieval.index
stages them through a local cache dir). A malformed URL, a missing bucket or unreachable storage is one line
on stderr and exit status 2, before any encoder is loaded.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

import gin

from rexrag_jax.io import paths
from rexrag_jax.retrieval.index import Index, IndexExistsError, build_index, check_output_dir, local_dir_of
from rexrag_jax.retrieval.retriever import LocalRetriever
from rexrag_jax.retrieval.server import ServerLimits, serve
from rexrag_jax.config.cli_style import conventional


@gin.configurable("encoder", module="retrieval")
def make_encoder(kind: str = "minilm", model_dir: str | None = None, name: str | None = None,
                 max_length: int = 256, batch_size: int = 64, data_parallel: bool = False, dtype: str = "float32"):
    """kind: "minilm" (packaged all-MiniLM-L6-v2), "e5" (local e5-*-v2 dir, query:/passage: prefixes),
    or "bert" (any local HF BERT dir, no prefixes). dtype: activation dtype ("bfloat16" on TPU)."""
    from rexrag_jax.retrieval import encoder as E

    kw = dict(max_length=max_length, batch_size=batch_size, data_parallel=data_parallel, dtype=dtype)
    if kind == "minilm":
        return E.TextEncoder.from_pretrained(model_dir or E.default_minilm_dir(), name=name or "all-MiniLM-L6-v2", **kw)
    if model_dir is None:
        raise ValueError(f"retrieval.encoder.model_dir is required for kind={kind!r}")
    if kind == "e5":
        return E.e5_encoder(model_dir, **({"name": name} if name else {}), **kw)
    if kind == "bert":
        return E.TextEncoder.from_pretrained(model_dir, name=name, **kw)
    raise ValueError(f"retrieval.encoder.kind must be 'minilm', 'e5' or 'bert', got {kind!r}")


@gin.configurable("build", module="retrieval")
def build_settings(corpus_path: str = gin.REQUIRED, index_dir: str = gin.REQUIRED, searcher: str = "auto",
                   exact_max_rows: int = 100_000, shard_size: int = 65_536, scann_params: dict | None = None):
    return dict(corpus_path=corpus_path, index_dir=index_dir, searcher=searcher, exact_max_rows=exact_max_rows,
                shard_size=shard_size, scann_params=scann_params)


@gin.configurable("serve", module="retrieval")
def serve_settings(host: str = "127.0.0.1", port: int = 8000, searcher: str | None = None,
                   max_queries: int = 4096, max_topk: int = 100, max_batch_queries: int = 512, default_topk: int = 3):
    return dict(host=host, port=port, searcher=searcher,
                limits=ServerLimits(max_queries=max_queries, max_topk=max_topk, max_batch_queries=max_batch_queries,
                                    default_topk=default_topk))


def _parse(argv, prog, extra):
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--gin_file", dest="gin_file", action="append", default=[],
                   help="gin config file (repeatable; default: none)")
    p.add_argument("--gin_bindings", "--gin_param", dest="gin_bindings",
                   action="append", default=[], help="gin binding (repeatable; default: none)")
    for args, kw in extra:
        p.add_argument(*args, **kw)
    return conventional(p).parse_args(argv)


class ConfigError(ValueError):
    """A gin file that cannot be read, an unknown configurable/parameter or a syntax error (one line)."""


def _parse_gin(files, bindings) -> None:
    try:
        gin.parse_config_files_and_bindings(files, bindings)
    except Exception as e:  # noqa: BLE001  gin raises OSError / ValueError / SyntaxError / TokenError
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()] or [type(e).__name__]
        where = next((ln for ln in lines[1:] if ln.startswith("In ")), None)
        raise ConfigError("bad gin config: " + lines[0] + (f" ({where})" if where else "")) from None


def _gin_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _remote_errors_exit_2(prog: str):
    """RemotePathError (bad URL, missing bucket, unreachable storage) and IndexExistsError (a finished or
    stale output without --overwrite) -> `prog: message` on stderr, exit 2."""
    def wrap(fn):
        @functools.wraps(fn)
        def inner(argv=None) -> int:
            try:
                return fn(argv)
            except (paths.RemotePathError, IndexExistsError, ConfigError) as e:
                print(f"{prog}: {e}", file=sys.stderr)
                return 2
        return inner
    return wrap


def _check_remote(*urls) -> None:
    """Bucket checks for the remote ones of `urls` (each raises RemotePathError, one line)."""
    for u in urls:
        if u and paths.is_remote(u):
            paths.check_remote_dir(u)


@_remote_errors_exit_2("rexrag build-index")
def build_index_main(argv=None) -> int:
    a = _parse(argv, "rexrag build-index", [
        (("--corpus",), dict(help="corpus jsonl/json (= retrieval.build.corpus_path)")),
        (("--index_dir",), dict(help="output index directory (= retrieval.build.index_dir)")),
        (("--overwrite",), dict(action="store_true", help="replace a finished index at --index_dir (default: off, "
                                                          "refused); build-index also discards a partial build")),
        (("--quiet",), dict(action="store_true", help="no progress bar"))])
    bindings = list(a.gin_bindings)
    if a.corpus:
        bindings.append(f"retrieval.build.corpus_path = {_gin_str(a.corpus)}")
    if a.index_dir:
        bindings.append(f"retrieval.build.index_dir = {_gin_str(a.index_dir)}")
    _parse_gin(a.gin_file, bindings)
    settings = build_settings()
    _check_remote(settings["index_dir"], settings["corpus_path"])  # cheap errors before the encoder loads
    check_output_dir(settings["index_dir"], a.overwrite)
    encoder = make_encoder()
    config = gin.config_str()
    index_dir = build_index(encoder=encoder, progress=not a.quiet, extra_files={"config.gin": config},
                            partial="discard" if a.overwrite else "strict", **settings)
    m = Index.load(index_dir).manifest
    print(f"index written to {index_dir}: {m['count']} passages x {m['dim']} ({m['searcher']}), encoder {m['encoder']['name']}")
    return 0


@_remote_errors_exit_2("rexrag merge-index")
def merge_index_main(argv=None) -> int:
    """Merge part indexes built on separate hosts (docs/retrieval.md). The searcher and ScaNN settings
    come from `retrieval.build.searcher / exact_max_rows / scann_params` (e.g. gin/retriever/e5_scann.gin);
    the first part's config.gin is carried over, so serve-retriever encodes queries like the parts did."""
    from rexrag_jax.retrieval.merge import merge_indexes

    a = _parse(argv, "rexrag merge-index", [
        (("--parts",), dict(nargs="+", required=True, help="part index directories, in corpus order")),
        (("--index_dir",), dict(required=True, help="output index directory")),
        (("--corpus_parts",), dict(nargs="+", default=None,
                                   help="part corpus files, if they moved since the parts were built")),
        (("--overwrite",), dict(action="store_true", help="replace a finished index at --index_dir (default: off, "
                                                          "refused); build-index also discards a partial build")),
        (("--quiet",), dict(action="store_true", help="no progress bar"))])
    _parse_gin(a.gin_file, a.gin_bindings)

    def bound(name, default):
        try:
            return gin.query_parameter(f"retrieval.build.{name}")
        except ValueError:
            return default

    _check_remote(a.index_dir, *a.parts, *(a.corpus_parts or []))
    check_output_dir(a.index_dir, a.overwrite)
    cfg_path = paths.join(a.parts[0], "config.gin")
    extra = {}
    if paths.isfile(cfg_path):
        extra["config.gin"] = paths.read_text(cfg_path)
    index_dir = merge_indexes(a.parts, a.index_dir, searcher=bound("searcher", "auto"),
                              exact_max_rows=bound("exact_max_rows", 100_000), scann_params=bound("scann_params", None),
                              corpus_paths=a.corpus_parts, extra_files=extra, progress=not a.quiet)
    m = Index.load(index_dir).manifest
    print(f"merged {len(a.parts)} parts into {index_dir}: {m['count']} passages x {m['dim']} ({m['searcher']}), "
          f"corpus sha256 {m['corpus']['sha256'][:12]}…")
    return 0


@_remote_errors_exit_2("rexrag serve-retriever")
def serve_main(argv=None) -> int:
    a = _parse(argv, "rexrag serve-retriever", [
        (("--index_dir",), dict(required=True, help="index directory written by `rexrag build-index`")),
        (("--host",), dict(default=None, help="bind address (default 127.0.0.1)")),
        (("--port",), dict(type=int, default=None, help="port to listen on (default: retrieval.server port, 8000)"))])
    local = local_dir_of(a.index_dir)  # a gs:// index: its local cache copy (downloaded when stale)
    files = [f for f in [os.path.join(local, "config.gin")] if os.path.isfile(f)] + a.gin_file
    bindings = list(a.gin_bindings)
    if a.host:
        bindings.append(f"retrieval.serve.host = {_gin_str(a.host)}")
    if a.port is not None:
        bindings.append(f"retrieval.serve.port = {a.port}")
    gin.parse_config_files_and_bindings(files, bindings)
    s = serve_settings()
    encoder = make_encoder()
    retriever = LocalRetriever(Index.load(a.index_dir, encoder=encoder, searcher=s["searcher"]), encoder)
    retriever.search(["warm up"], 3)  # compile the query path before the first client arrives
    serve(retriever, s["host"], s["port"], s["limits"])
    return 0

