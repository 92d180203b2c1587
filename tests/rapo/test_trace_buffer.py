"""TraceBuffer: add / query (vs brute force) / FIFO eviction / save-load, step extraction from trajectories."""
import json
import os

import numpy as np
import pytest

from rexrag_jax.data.schema import QAExample
from rexrag_jax.rapo.trace_buffer import SEG_RETRIEVED, TraceBuffer, history_key, trajectory_steps
from rexrag_jax.rollout import types as T
from rapo_fakes import ToyTokenizer, bow_encode

TOK = ToyTokenizer()


def make_buffer(n=0, **kw):
    buf = TraceBuffer(bow_encode, **kw)
    if n:
        buf.add([f"question {i} about topic{i}" for i in range(n)], [f"<search> step {i} </search>" for i in range(n)])
    return buf


def test_query_matches_brute_force_and_exact_key():
    buf = make_buffer(40, capacity=100, searcher="exact")
    queries = ["topic7 question", "about topic31", "something else entirely topic3"]
    hits = buf.query(queries, k=5)
    emb = bow_encode([f"question {i} about topic{i}" for i in range(40)])
    scores = bow_encode(queries) @ emb.T
    for q, h in enumerate(hits):
        assert len(h) == 5
        np.testing.assert_allclose([x["score"] for x in h], np.sort(scores[q])[::-1][:5], atol=1e-5)
        assert h[0]["index"] == int(np.argmax(scores[q]))
        assert h[0]["value"] == f"<search> step {h[0]['index']} </search>"
    assert buf.query(["question 12 about topic12"], k=1)[0][0]["value"] == "<search> step 12 </search>"
    assert make_buffer().query(["anything"], k=3) == [[]]


def test_scann_searcher_agrees_with_exact_on_top1():
    n = 300
    exact, scann = make_buffer(n, capacity=n, searcher="exact"), make_buffer(n, capacity=n, searcher="scann")
    queries = [f"question {i} about topic{i}" for i in range(0, n, 7)]
    e, s = exact.query(queries, 3), scann.query(queries, 3)
    # ties are possible (hashed words), so compare scores; the stored key itself scores 1
    np.testing.assert_allclose([[x["score"] for x in a] for a in e], [[x["score"] for x in b] for b in s], atol=1e-4)
    assert np.mean([b[0]["key"] == q for q, b in zip(queries, s)]) >= 0.9
    assert type(scann._get_searcher()).__name__ == "ScannSearcher"


def test_fifo_eviction():
    buf = make_buffer(capacity=5)
    assert buf.add([f"k{i}" for i in range(3)], [f"v{i}" for i in range(3)]) == 0
    assert buf.add([f"k{i}" for i in range(3, 8)], [f"v{i}" for i in range(3, 8)]) == 3
    assert len(buf) == 5 and buf.keys == [f"k{i}" for i in range(3, 8)] and buf.values == [f"v{i}" for i in range(3, 8)]
    assert buf.emb.shape == (5, 1024) and buf.total_added == 8
    np.testing.assert_allclose(buf.emb, bow_encode([f"k{i}" for i in range(3, 8)]))
    assert buf.query(["k0"], 5)[0] and all(h["value"] != "v0" for h in buf.query(["k0"], 5)[0])
    buf.add([f"x{i}" for i in range(12)], [f"y{i}" for i in range(12)])  # more than capacity at once
    assert buf.values == [f"y{i}" for i in range(7, 12)]


def test_bad_input_errors():
    with pytest.raises(ValueError, match="2 histories but 1 steps"):
        make_buffer().add(["a", "b"], ["c"])
    with pytest.raises(ValueError, match="capacity=0"):
        TraceBuffer(bow_encode, capacity=0)
    buf = TraceBuffer(lambda texts: np.ones((len(texts) + 1, 4)))
    with pytest.raises(ValueError, match="expected \\[n, d\\]"):
        buf.add(["a"], ["b"])


def test_save_load_roundtrip_and_atomic_overwrite(tmp_path):
    buf = make_buffer(7, capacity=10)
    path = tmp_path / "buf"
    buf.save(str(path))
    loaded = TraceBuffer.load(str(path), bow_encode)
    assert loaded.keys == buf.keys and loaded.values == buf.values and loaded.capacity == 10
    np.testing.assert_array_equal(loaded.emb, buf.emb)
    assert loaded.query(["topic3"], 2) == buf.query(["topic3"], 2)
    # overwrite: a failing save leaves the previous copy intact
    bad = make_buffer(2)
    bad.encoder_name = object()  # not JSON-serialisable: json.dump fails mid-way
    with pytest.raises(TypeError):
        bad.save(str(path))
    assert TraceBuffer.load(str(path), bow_encode).keys == buf.keys
    assert sorted(os.listdir(tmp_path)) == ["buf"]  # no temp dirs left behind
    # a second save replaces it
    make_buffer(3).save(str(path))
    assert len(TraceBuffer.load(str(path), bow_encode)) == 3
    # smaller capacity on load keeps the newest
    assert TraceBuffer.load(str(path), bow_encode, capacity=2).values == ["<search> step 1 </search>",
                                                                         "<search> step 2 </search>"]


def test_load_errors(tmp_path):
    path = tmp_path / "buf"
    make_buffer(3).save(str(path))
    with pytest.raises(ValueError, match="dim 1024 but encode_fn gives 8"):
        TraceBuffer.load(str(path), lambda texts: np.ones((len(texts), 8), np.float32))
    meta = json.loads((path / "entries.json").read_text())
    meta["encoder"] = "all-MiniLM-L6-v2"
    (path / "entries.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="saved with encoder 'all-MiniLM-L6-v2', loading with 'custom'"):
        TraceBuffer.load(str(path), bow_encode)
    (path / "entries.json").write_text("{not json")
    with pytest.raises(ValueError, match="entries.json: cannot read"):
        TraceBuffer.load(str(path), bow_encode)


def _record(chunks, ex):
    toks, segs = [], []
    for seg, text in chunks:
        ids = TOK.encode(text)
        toks += ids
        segs += [seg] * len(ids)
    return dict(tokens=toks, segments=segs, logprobs=[0.0] * len(toks), group_id=0, is_probe=False,
                probe_start=-1, probe_len=0, num_searches=1, example=ex, response_text="")


def test_trajectory_steps_and_add_successful():
    ex = QAExample("0", "who is x", ["X"], "nq")
    chunks = [(T.SEG_PROMPT, "PROMPT "), (T.SEG_RESPONSE, "<think> a </think><search> q1 </search>"),
              (T.SEG_INFO, "\n\n<information>doc</information>\n\n"),
              (SEG_RETRIEVED, "<search> stored </search>"), (T.SEG_INFO, "<information>d2</information>"),
              (T.SEG_RESPONSE, "<answer> X </answer>")]
    batch = T.TrajectoryBatch.from_records([_record(chunks, ex), _record(chunks[:2], ex)], pad_id=0)
    steps = trajectory_steps(batch, 0, TOK.decode)
    body = [c[1] for c in chunks[1:]]
    # a step is (thought, action, observation): the search step carries the information that followed it
    assert steps == [(history_key("who is x", ""), body[0] + body[1]),
                     (history_key("who is x", "".join(body[:4])), body[4])]
    assert trajectory_steps(batch, 0, TOK.decode, with_observation=False)[0][1] == body[0]
    assert history_key("q ", "abcdef", max_chars=3) == "q\ndef"
    buf = make_buffer()
    assert buf.add_successful(batch, np.array([1.0, 0.0]), TOK.decode) == 2
    assert buf.values == [body[0] + body[1], body[4]]
    with pytest.raises(ValueError, match="rewards shape"):
        buf.add_successful(batch, np.array([1.0]), TOK.decode)


def test_real_minilm_keys_find_paraphrased_histories(tmp_path):
    from rexrag_jax.rapo.trace_buffer import minilm_encode_fn
    enc = minilm_encode_fn(max_length=64, batch_size=8)
    buf = TraceBuffer(enc, searcher="exact")
    assert buf.encoder_name == "all-MiniLM-L6-v2"
    buf.add([history_key("who wrote hamlet", ""),
             history_key("capital of france", "<think> I need the capital </think>"),
             history_key("how tall is mount everest", "")],
            ["<search> hamlet author </search>", "<answer> Paris </answer>", "<search> everest height </search>"])
    assert buf.emb.shape == (3, 384)
    np.testing.assert_allclose(np.linalg.norm(buf.emb, axis=1), 1.0, atol=1e-5)
    hits = buf.query([history_key("Who is the author of the play Hamlet?", ""),
                      history_key("What is the French capital city?", ""),
                      history_key("height of Everest in meters", "")], 1)
    assert [h[0]["index"] for h in hits] == [0, 1, 2]
    buf.save(str(tmp_path / "b"))
    with pytest.raises(ValueError, match="saved with encoder 'all-MiniLM-L6-v2', loading with 'custom'"):
        TraceBuffer.load(str(tmp_path / "b"), bow_encode)
    reloaded = TraceBuffer.load(str(tmp_path / "b"), enc)
    assert reloaded.query([history_key("author of Hamlet", "")], 1)[0][0]["index"] == 0
