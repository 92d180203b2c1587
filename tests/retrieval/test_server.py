"""POST /retrieve: Search-R1 payload, 4xx on bad input while serving on, clients agree, bounded load test."""
import concurrent.futures as cf
import http.client
import json
import time

import pytest

from rexrag_jax.retrieval.index import Index, build_index
from rexrag_jax.retrieval.retriever import HttpRetriever, LocalRetriever
from rexrag_jax.retrieval.server import ServerLimits, running_server


@pytest.fixture(scope="module")
def local(shared_data, tiny_encoder, tmp_path_factory):
    src = shared_data / "corpus" / "wiki18_sample_1000.jsonl"
    path = tmp_path_factory.mktemp("c") / "wiki200.jsonl"
    path.write_text("".join(open(src).readlines()[:200]))
    d = str(tmp_path_factory.mktemp("idx") / "i")
    build_index(str(path), d, tiny_encoder, progress=False)
    return LocalRetriever(Index.load(d, encoder=tiny_encoder), tiny_encoder)


@pytest.fixture(scope="module")
def url(local):
    with running_server(local, limits=ServerLimits(max_queries=64)) as u:
        yield u


def post(url, body: bytes, path="/retrieve"):
    host, port = url.split("//")[1].split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=30)
    c.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, json.loads(data)


QUERIES = ["who was evan morris", "capital of france"]


def test_search_r1_payload(url, local):
    status, out = post(url, json.dumps({"queries": QUERIES, "topk": 3, "return_scores": True}).encode())
    assert status == 200 and list(out) == ["result"] and len(out["result"]) == 2
    want = local.search(QUERIES, 3)
    for row, ref in zip(out["result"], want):
        assert len(row) == 3
        assert [set(h) for h in row] == [{"document", "score"}] * 3
        assert set(row[0]["document"]) == {"id", "contents"}
        assert [h["document"]["id"] for h in row] == [h["document"]["id"] for h in ref]
        assert [h["score"] for h in row] == pytest.approx([h["score"] for h in ref], abs=1e-6)


def test_without_scores_returns_bare_documents(url, local):
    status, out = post(url, json.dumps({"queries": QUERIES[:1], "topk": 2, "return_scores": False}).encode())
    assert status == 200
    assert out["result"] == [[h["document"] for h in local.search(QUERIES[:1], 2)[0]]]


def test_http_client_equals_local_client(url, local):
    assert HttpRetriever(url).search(QUERIES, 4) == local.search(QUERIES, 4)


@pytest.mark.parametrize("body,status,msg", [
    (b'{"queries": ["a"', 400, "malformed JSON"),
    (b'{"topk": 3}', 400, "'queries' is missing"),
    (b'{"queries": "a"}', 400, "must be a list"),
    (b'{"queries": []}', 400, "is empty"),
    (b'{"queries": ["a", 3]}', 400, r"queries\[1\] must be a string"),
    (b'{"queries": ["a", "  "]}', 400, r"queries\[1\] is empty"),
    (b'{"queries": ["a"], "topk": -1}', 400, "'topk' must be in"),
    (b'{"queries": ["a"], "topk": 101}', 400, "'topk' must be in"),
    (b'{"queries": ["a"], "topk": "3"}', 400, "'topk' must be an integer"),
    (b'{"queries": ["a"], "return_scores": "yes"}', 400, "'return_scores'"),
    (b'["a"]', 400, "expected a JSON object"),
    (b'{"queries": ["\xff\xfe"]}', 400, "not valid UTF-8"),
    (b'{"queries": ["ok", "\\ud800"]}', 400, r"queries\[1\] contains an unpaired surrogate"),
    (json.dumps({"queries": ["q"] * 10_000}).encode(), 413, "at most 64"),
])
def test_bad_requests_get_4xx_and_server_keeps_serving(url, body, status, msg):
    import re

    got, out = post(url, body)
    assert got == status and re.search(msg, out["error"]), out
    ok, res = post(url, json.dumps({"queries": ["still alive"], "topk": 1}).encode())
    assert ok == 200 and len(res["result"][0]) == 1


@pytest.mark.parametrize("body", [b'{"queries": ["capital of france"], "topk": 0}',
                                  b'{"queries": ["capital of france"]}',
                                  b'{"queries": ["capital of france"], "topk": null}'])
def test_topk_zero_or_missing_means_default_topk(url, body):
    """Search-R1's server: `if not request.topk: request.topk = config.retrieval_topk` (3 by default)."""
    status, out = post(url, body)
    assert status == 200 and len(out["result"][0]) == 3, out


def test_parse_request_default_topk_is_configurable():
    from rexrag_jax.retrieval.server import parse_request

    limits = ServerLimits(default_topk=5)
    assert parse_request(b'{"queries": ["a"], "topk": 0}', limits)[1] == 5
    assert parse_request(b'{"queries": ["a"]}', limits)[1] == 5
    assert parse_request(b'{"queries": ["a"], "topk": 2}', limits)[1] == 2


def test_unknown_path_is_404(url):
    assert post(url, b"{}", path="/search")[0] == 404


def test_bounded_concurrent_load(url):
    """16 concurrent clients x 8 requests: zero 5xx, every response well-formed (full load test: benchmarks/)."""
    def client(i):
        out = []
        for j in range(8):
            t = time.perf_counter()
            s, res = post(url, json.dumps({"queries": [f"query {i} {j}"], "topk": 3, "return_scores": True}).encode())
            out.append((s, len(res.get("result", [[]])[0]), time.perf_counter() - t))
        return out

    with cf.ThreadPoolExecutor(16) as ex:
        results = [r for rs in ex.map(client, range(16)) for r in rs]
    assert len(results) == 128
    assert all(s == 200 and n == 3 for s, n, _ in results)
