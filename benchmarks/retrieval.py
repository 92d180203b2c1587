"""Retrieval benchmarks: ScaNN vs faiss IndexFlatIP (the reference index), real retrieval quality, server load.

Sections (--sections, comma separated):
  ann      recall@10 vs exact and QPS of ScaNN (tree + AH + reorder, and AH over every point + reorder)
           vs faiss-cpu IndexFlatIP on 1M x 384 unit vectors (uniform random: the hard case; and a
           clustered mixture), one thread each, batched and single-query timing protocols.
  ann_cov  the same on 1M vectors drawn from a Gaussian fitted to the real MiniLM passage embeddings,
           queried with real MiniLM question embeddings.
  real     the same comparison on MiniLM embeddings of the shared corpora (hotpot paragraphs + wiki-18
           sample + 2Wiki paragraphs), queries = HotpotQA + 2Wiki dev questions.
  quality  recall@3/10 of gold supporting paragraphs on HotpotQA-100 (pool = its 994 paragraphs, and the
           same pool inside all ~8k shared passages): MiniLM (this repo, exact) vs BM25 (bm25s).
  load     64 concurrent HTTP clients x 50 requests against `POST /retrieve` on 127.0.0.1 (MiniLM + exact
           over the wiki-18 sample): zero 5xx required, p50/p99 latency printed.

    python benchmarks/retrieval.py --sections ann,real,quality,load
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import hashlib
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "shared", "data")


def unit(x):
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def recall_at(found, truth, k=10):
    return float(np.mean([len(set(a[:k]) & set(b[:k])) / k for a, b in zip(found, truth)]))


# Two timing protocols, both single-threaded on both sides:
#  batched: all queries in one call (what the Search-R1 retrieval server does with a batch of agent
#           queries; faiss then scores with one BLAS GEMM, which is its fastest path);
#  single:  one call per query (the ann-benchmarks protocol; an online server answering one question).
SINGLE_QUERIES = 100
TRAIN_SAMPLE = 100_000  # --train_sample
NUM_LEAVES = None       # --num_leaves (1M sets; default ~sqrt(n))
TREE_OPTIONS: dict = {}  # --spherical, --soar_lambda


def faiss_flat(db, q, k):
    """-> (exact top-k ids, batched QPS, single-query QPS) of faiss IndexFlatIP on one thread."""
    import faiss

    faiss.omp_set_num_threads(1)
    index = faiss.IndexFlatIP(db.shape[1])
    index.add(db)
    t = time.perf_counter()
    _, idx = index.search(q, k)
    qps = len(q) / (time.perf_counter() - t)
    m = min(SINGLE_QUERIES, len(q))
    t = time.perf_counter()
    for i in range(m):
        index.search(q[i:i + 1], k)
    return idx, qps, m / (time.perf_counter() - t)


# (fraction of leaves searched, reorder_k) for the tree; reorder_k alone for the tree-less searcher
SWEEP = ((0.01, 100), (0.025, 100), (0.025, 400), (0.05, 100), (0.05, 400), (0.1, 200), (0.1, 800), (0.125, 250),
         (0.15, 300), (0.175, 350), (0.2, 400), (0.4, 800), (1.0, 1000))
NO_TREE_SWEEP = (100, 200, 300, 500, 1000)


def time_searcher(s, q, truth, k):
    """recall@k and QPS of one searcher setting under both protocols (the single-query recall is over
    the first SINGLE_QUERIES queries and equals the batched one's on them: same ScaNN search)."""
    s.search(q[:50], k)  # warm
    t = time.perf_counter()
    idx, _ = s.search(q, k)
    qps = len(q) / (time.perf_counter() - t)
    m = min(SINGLE_QUERIES, len(q))
    s.search_one(q[0], k)
    t = time.perf_counter()
    for i in range(m):
        s.search_one(q[i], k)
    return {"recall@10": recall_at(idx, truth, k), "qps": qps, "qps_single": m / (time.perf_counter() - t)}


def scann_sweep(name, db, q, truth, k=10, num_leaves=None):
    """Build the tree searcher and the tree-less one once each, then sweep their search knobs."""
    from rexrag_jax.retrieval.searcher import ScannSearcher

    rows = []
    t = time.perf_counter()
    # 100k training sample (default rule: 250k) keeps the 1M builds to minutes on a shared 2-core box.
    s = ScannSearcher.build(db, training_sample_size=min(len(db), TRAIN_SAMPLE), **TREE_OPTIONS,
                            **({"num_leaves": num_leaves} if num_leaves else {}))
    s.set_num_threads(1)
    build_s = time.perf_counter() - t
    done = set()
    for frac, reorder in SWEEP:
        leaves = max(1, round(frac * s.params["num_leaves"]))
        if (leaves, reorder) in done:
            continue
        done.add((leaves, reorder))
        s.params.update(num_leaves_to_search=leaves, reorder_k=reorder)
        rows.append({"tree": f"{leaves}/{s.params['num_leaves']}", "reorder_k": reorder,
                     **time_searcher(s, q, truth, k)})
    print(f"  ScaNN tree build {build_s:.1f}s, {s.params['num_leaves']} leaves, AH dims/block 2, threshold 0.2, "
          f"spherical {s.params['spherical']}, SOAR lambda {s.params['soar_lambda']}")
    del s
    t = time.perf_counter()
    s = ScannSearcher.build(db, num_leaves=0, training_sample_size=min(len(db), TRAIN_SAMPLE))
    s.set_num_threads(1)
    print(f"  ScaNN no-tree (AH over every point) build {time.perf_counter() - t:.1f}s")
    for reorder in NO_TREE_SWEEP:
        s.params.update(reorder_k=reorder)
        rows.append({"tree": "none", "reorder_k": reorder, **time_searcher(s, q, truth, k)})
    return rows, build_s


def best_at(rows, key, base):
    ok = [r for r in rows if r["recall@10"] >= 0.95]
    if not ok:
        return None
    best = max(ok, key=lambda r: r[key])
    return {"ratio": best[key] / base, "recall@10": best["recall@10"], "tree": best["tree"],
            "reorder_k": best["reorder_k"]}


def report_ann(name, db, q, k=10, num_leaves=None):
    num_leaves = num_leaves or (NUM_LEAVES if len(db) >= 100_000 else None)
    print(f"\n[{name}] db {db.shape}, {len(q)} queries, top-{k}, 1 search thread each; "
          f"load average {os.getloadavg()[0]:.1f}")
    truth, faiss_qps, faiss_single = faiss_flat(db, q, k)
    rows, _ = scann_sweep(name, db, q, truth, k, num_leaves)
    print(f"  faiss IndexFlatIP: recall@10 1.000, batched {faiss_qps:9.1f} QPS, single-query {faiss_single:9.1f} QPS")
    print(f"  {'ScaNN tree':>16} {'reorder':>7} {'recall@10':>9} {'batched QPS':>12} {'vs faiss':>9} "
          f"{'single QPS':>11} {'vs faiss':>9}")
    for r in rows:
        print(f"  {r['tree']:>16} {r['reorder_k']:7d} {r['recall@10']:9.3f} {r['qps']:12.1f} "
              f"{r['qps'] / faiss_qps:8.1f}x {r['qps_single']:11.1f} {r['qps_single'] / faiss_single:8.1f}x")
    best = {"batched": best_at(rows, "qps", faiss_qps), "single": best_at(rows, "qps_single", faiss_single)}
    for proto, b in best.items():
        if b:
            print(f"  => {proto}: best at recall@10 >= 0.95: {b['ratio']:.1f}x faiss QPS (recall {b['recall@10']:.3f}, "
                  f"tree {b['tree']}, reorder {b['reorder_k']})")
        else:
            print(f"  => {proto}: no swept setting reaches recall@10 >= 0.95")
    print(f"  load average now {os.getloadavg()[0]:.1f}")
    return {"name": name, "faiss_qps": faiss_qps, "faiss_qps_single": faiss_single, "scann": rows, "best": best}


def section_ann(args):
    rng = np.random.default_rng(0)
    n, d = args.n, 384
    out = []
    db = unit(rng.standard_normal((n, d), dtype=np.float32))
    q = unit(rng.standard_normal((args.queries, d), dtype=np.float32))
    out.append(report_ann(f"uniform random unit vectors {n}x{d}", db, q))
    del db
    # Clustered: 2,000 centres, within-cluster noise at ~0.7x the centre norm (cos to centre ~0.8).
    centres = rng.standard_normal((2000, d), dtype=np.float32)
    lab = rng.integers(0, 2000, n + args.queries)
    pts = np.empty((n + args.queries, d), np.float32)
    for s in range(0, len(pts), 200_000):
        e = min(len(pts), s + 200_000)
        pts[s:e] = unit(centres[lab[s:e]] + 0.75 * rng.standard_normal((e - s, d), dtype=np.float32))
    out.append(report_ann(f"clustered mixture (2000 centres) {n}x{d}", pts[:n], pts[n:]))
    return out


def section_ann_cov(args):
    """1M vectors from a Gaussian with the mean/covariance of the real MiniLM passage embeddings
    (normalised), queried with the real MiniLM question embeddings: second-order statistics of real data
    at a scale where ANN matters."""
    _, texts, _, _ = shared_passages()
    emb = cached_encode(texts, "passage", args.cache_dir).astype(np.float64)
    q = cached_encode(questions(), "query", args.cache_dir)[: args.queries]
    mu, cov = emb.mean(0), np.cov(emb, rowvar=False)
    chol = np.linalg.cholesky(cov + 1e-6 * np.eye(len(mu)))
    rng = np.random.default_rng(0)
    db = np.empty((args.n, emb.shape[1]), np.float32)
    for s in range(0, args.n, 200_000):
        e = min(args.n, s + 200_000)
        db[s:e] = unit(mu + rng.standard_normal((e - s, len(mu))) @ chol.T)
    return [report_ann(f"Gaussian fit to MiniLM passage embeddings {args.n}x{db.shape[1]}, real queries", db, q)]


def shared_passages():
    """(ids, contents) of hotpot-100 paragraphs + wiki-18 sample + 2Wiki paragraphs, and hotpot rows."""
    from rexrag_jax.retrieval.corpus import iter_corpus

    hot = json.load(open(os.path.join(DATA, "corpus", "hotpotqa_train_100_with_paragraphs.json")))
    ids, texts, seen = [], [], set()
    for row in hot:
        for title, sents in row["context"]:
            if title not in seen:
                seen.add(title)
                ids.append("hotpot:" + title)
                texts.append(f'"{title}"\n' + "".join(sents))
    n_hot = len(ids)
    for tag, f in (("wiki18", "wiki18_sample_1000.jsonl"), ("2wiki", "2wiki_paragraphs.json")):
        for p in iter_corpus(os.path.join(DATA, "corpus", f)):
            ids.append(f"{tag}:{p.id}")
            texts.append(p.contents)
    return ids, texts, n_hot, hot


_ENC = None


def minilm():
    global _ENC
    if _ENC is None:
        from rexrag_jax.retrieval.encoder import minilm_encoder

        _ENC = minilm_encoder(batch_size=64)
    return _ENC


def cached_encode(texts, kind, cache_dir):
    key = hashlib.sha256(("\x00".join(texts) + kind).encode()).hexdigest()[:16]
    path = os.path.join(cache_dir, f"minilm_{kind}_{len(texts)}_{key}.npy")
    if os.path.isfile(path):
        return np.load(path)
    t = time.perf_counter()
    e = minilm().encode(texts, kind=kind, progress=True)
    print(f"  encoded {len(texts)} {kind}s with MiniLM (JAX) in {time.perf_counter() - t:.0f}s")
    os.makedirs(cache_dir, exist_ok=True)
    np.save(path + ".tmp.npy", e)
    os.replace(path + ".tmp.npy", path)
    return e


def questions():
    hot = json.load(open(os.path.join(DATA, "corpus", "hotpotqa_train_100_with_paragraphs.json")))
    qs = [r["question"] for r in hot]
    with open(os.path.join(DATA, "benchmarks", "2wiki_dev_500.jsonl")) as f:
        qs += [json.loads(line)["question"] for line in f]
    return qs


def section_real(args):
    ids, texts, _, _ = shared_passages()
    db = cached_encode(texts, "passage", args.cache_dir)
    q = cached_encode(questions(), "query", args.cache_dir)
    return [report_ann(f"MiniLM embeddings of the shared corpora {db.shape[0]}x{db.shape[1]}", db, q)]


def section_quality(args):
    import bm25s

    from rexrag_jax.retrieval.searcher import exact_topk

    ids, texts, n_hot, hot = shared_passages()
    emb = cached_encode(texts, "passage", args.cache_dir)
    qs = [r["question"] for r in hot]
    qemb = cached_encode(qs, "query", args.cache_dir)
    gold = [{"hotpot:" + t for t, _ in r["supporting_facts"]} for r in hot]
    out = {}
    print("\n[HotpotQA-100 gold supporting paragraphs] recall@k = mean over questions of |gold in top-k| / |gold|")
    for pool_name, n in (("hotpot pool (994 paragraphs)", n_hot), (f"all shared passages ({len(ids)})", len(ids))):
        tok = bm25s.tokenize(texts[:n], stopwords="en", show_progress=False)
        bm = bm25s.BM25()
        bm.index(tok, show_progress=False)
        bm_idx, _ = bm.retrieve(bm25s.tokenize(qs, stopwords="en", show_progress=False), k=10, show_progress=False)
        dense_idx, _ = exact_topk(emb[:n], qemb, 10)
        for method, idx in (("MiniLM (exact)", dense_idx), ("BM25 (bm25s)", bm_idx)):
            for k in (3, 10):
                r = float(np.mean([len(g & {ids[i] for i in row[:k]}) / len(g) for g, row in zip(gold, idx)]))
                out[f"{pool_name} | {method} | recall@{k}"] = r
            print(f"  {pool_name:34s} {method:15s} recall@3 {out[f'{pool_name} | {method} | recall@3']:.3f}  "
                  f"recall@10 {out[f'{pool_name} | {method} | recall@10']:.3f}")
    return out


class _CachedPassageEncoder:
    """MiniLM for queries; passages looked up from the benchmark's embedding cache (same vectors)."""

    def __init__(self, enc, texts, emb):
        self.enc, self.table = enc, dict(zip(texts, emb))
        self.dim, self.describe = enc.dim, enc.describe

    def encode(self, texts, kind="passage", progress=False):
        if kind == "passage":
            return np.stack([self.table[t] for t in texts])
        return self.enc.encode(texts, kind, progress)


def section_load(args):
    import http.client

    from rexrag_jax.retrieval.corpus import read_corpus
    from rexrag_jax.retrieval.index import Index, build_index
    from rexrag_jax.retrieval.retriever import LocalRetriever
    from rexrag_jax.retrieval.server import running_server

    corpus = os.path.join(DATA, "corpus", "wiki18_sample_1000.jsonl")
    texts = [p.contents for p in read_corpus(corpus)]
    enc = _CachedPassageEncoder(minilm(), texts, cached_encode(texts, "passage", args.cache_dir))
    qs = questions()
    with tempfile.TemporaryDirectory() as d:
        build_index(corpus, os.path.join(d, "idx"), enc, searcher="exact", progress=False)
        retriever = LocalRetriever(Index.load(os.path.join(d, "idx")), minilm())
        for b in (1, 2, 4, 8, 16, 32, 64):  # compile every query batch bucket before timing
            retriever.search(qs[:b], 3)
        with running_server(retriever) as url:
            host, port = url.split("//")[1].split(":")

            def client(i):
                out = []
                for j in range(args.requests):
                    body = json.dumps({"queries": [qs[(i * args.requests + j) % len(qs)]], "topk": 3,
                                       "return_scores": True})
                    t = time.perf_counter()
                    c = http.client.HTTPConnection(host, int(port), timeout=300)
                    c.request("POST", "/retrieve", body=body, headers={"Content-Type": "application/json"})
                    r = c.getresponse()
                    data = r.read()
                    c.close()
                    ok = r.status == 200 and len(json.loads(data)["result"][0]) == 3
                    out.append((r.status, ok, time.perf_counter() - t))
                return out

            t = time.perf_counter()
            with cf.ThreadPoolExecutor(args.clients) as ex:
                res = [x for rs in ex.map(client, range(args.clients)) for x in rs]
            wall = time.perf_counter() - t
    lat = np.array([x[2] for x in res]) * 1000
    n5xx = sum(s >= 500 for s, _, _ in res)
    bad = sum(not ok for _, ok, _ in res)
    print(f"\n[load] {args.clients} clients x {args.requests} requests on 127.0.0.1 (MiniLM + exact, 1000 passages)")
    print(f"  {len(res)} requests in {wall:.1f}s = {len(res) / wall:.1f} req/s; 5xx: {n5xx}; malformed: {bad}; "
          f"latency p50 {np.percentile(lat, 50):.0f} ms, p99 {np.percentile(lat, 99):.0f} ms")
    return {"requests": len(res), "5xx": n5xx, "bad": bad, "p50_ms": float(np.percentile(lat, 50)),
            "p99_ms": float(np.percentile(lat, 99)), "req_per_s": len(res) / wall}


def main(argv=None):
    global NUM_LEAVES, TRAIN_SAMPLE
    p = argparse.ArgumentParser()
    p.add_argument("--sections", default="ann,real,quality,load")
    p.add_argument("--n", type=int, default=1_000_000, help="synthetic database size")
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--requests", type=int, default=50)
    p.add_argument("--cache_dir", default=os.path.join(tempfile.gettempdir(), "rexrag_retrieval_bench"))
    p.add_argument("--json_out", default=None)
    p.add_argument("--num_leaves", type=int, default=None, help="ScaNN tree leaves for the 1M sets (default ~sqrt(n))")
    p.add_argument("--train_sample", type=int, default=TRAIN_SAMPLE, help="ScaNN training sample (tree and AH)")
    p.add_argument("--spherical", action="store_true", help="spherical k-means tree")
    p.add_argument("--soar_lambda", type=float, default=None, help="SOAR spilling (e.g. 1.5)")
    args = p.parse_args(argv)
    NUM_LEAVES, TRAIN_SAMPLE = args.num_leaves, args.train_sample
    TREE_OPTIONS.update(spherical=args.spherical, soar_lambda=args.soar_lambda)
    results = {}
    for s in args.sections.split(","):
        results[s] = {"ann": section_ann, "ann_cov": section_ann_cov, "real": section_real, "quality": section_quality, "load": section_load}[s](args)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
