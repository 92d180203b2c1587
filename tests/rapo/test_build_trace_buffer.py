"""`rexrag build-trace-buffer` and the static trace buffer (SPEC §8, the paper's: built offline, top K of N
by reward, every step stored with its observation, checked at load): top-K selection by hand, steps with
observations (solver and the rollout-loop sampler), manifest checks (encoder, world, empty) -> one line and
exit 2, resume after an interrupted build = an uninterrupted one, a finished dir refused without
--overwrite, and the RAPO trainer on a static buffer (no online filling, nothing copied into the run)."""
import json

import numpy as np
import pytest

from rexrag_jax.data.schema import QAExample
from rexrag_jax.data.synthetic_world import WorldConfig, WorldRetriever, generate_world, write_world
from rexrag_jax.rapo import build_cli
from rexrag_jax.rapo.solver import NoisySolver, parse_question
from rexrag_jax.rapo.static_buffer import (Candidate, TraceBufferError, build_trace_buffer, load_static_buffer,
                                           questions_fingerprint, select_top_k)
from rexrag_jax.rapo.trace_buffer import history_key
from rapo_fakes import FakeRetriever, ScriptedEngine, ToyTokenizer, bow_encode


def named(fn, name, max_length=None):
    def enc(texts):
        return fn(texts)
    enc.encoder_name, enc.max_length = name, max_length
    return enc


BOW = named(bow_encode, "bow-1024")
WORLD_CFG = WorldConfig(seed=3, num_person=16, num_city=8, num_country=3, num_company=5,
                        train_per_hop=(3, 3, 3), test_per_hop=(1, 1, 1))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    w = generate_world(WORLD_CFG)
    files = write_world(w, str(tmp_path_factory.mktemp("world")))
    return w, files


def answers(*preds):
    """A sampler whose j-th sample answers preds[j] after one search step (observation 'obs j')."""
    def sampler(examples, n, seed, start):
        out = []
        for ex in examples:
            cands = []
            for j in range(n):
                s0 = f"<think> t{j} </think><search> {ex.id} q{j} </search>\n\n<information>obs {j}</information>\n\n"
                s1 = f"<think> done </think><answer> {preds[j]} </answer>"
                cands.append(Candidate(s0 + s1, [(history_key(ex.question, ""), s0), (history_key(ex.question, s0), s1)], 1))
            out.append(cands)
        return out
    return sampler


def test_select_top_k_by_hand():
    r = [0.0, 1.0, 0.5, 1.0, 1.0, 0.0, 1.0]
    assert select_top_k(r, 3) == [1, 3, 4]          # ties: earlier sample first
    assert select_top_k(r, 5) == [1, 3, 4, 6, 2]
    assert select_top_k(r, 6, min_reward=0.5) == [1, 3, 4, 6, 2]
    assert select_top_k(r, 5, min_reward=1.0) == [1, 3, 4, 6]
    assert select_top_k([0.0] * 4, 2) == [0, 1]


def test_build_keeps_top_k_and_stores_observations(tmp_path):
    ex = [QAExample("a", "Who is x?", ["A"], "nq"), QAExample("b", "Who is y?", ["B"], "nq")]
    # rewards (EM): question a (gold A): samples 1, 3, 4 right; question b (gold B): samples 0 and 5
    sampler = answers("B", "A", "C", "A", "A", "B", "x")
    m = build_trace_buffer(str(tmp_path / "buf"), ex, sampler, BOW, n=7, k=3, shard_size=1, progress=False)
    rows = [json.loads(line) for line in (tmp_path / "buf" / "steps.jsonl").read_text().splitlines()]
    kept = [(r["qid"], r["sample"], r["rank"], r["reward"]) for r in rows if r["step"] == 0]
    assert kept == [("a", 1, 0, 1.0), ("a", 3, 1, 1.0), ("a", 4, 2, 1.0),
                    ("b", 0, 0, 1.0), ("b", 5, 1, 1.0), ("b", 1, 2, 0.0)]
    assert m["count"] == 12 and m["counts"]["trajectories_kept"] == 6 and m["counts"]["trajectories_sampled"] == 14
    assert m["counts"]["insertable_steps"] == 6 and m["counts"]["answer_steps"] == 6
    assert m["rewards"]["sampled_mean"] == pytest.approx(5 / 14) and m["rewards"]["kept_below_1"] == 1
    search = [r for r in rows if r["kind"] == "search"]
    assert all(r["insertable"] and f"<information>obs {r['sample']}</information>" in r["value"] for r in search)
    ans = [r for r in rows if r["kind"] == "answer"]
    assert all(r["key"].startswith(r["question"] + "\n<think> t") and "<information>obs" in r["key"] for r in ans)
    emb = np.load(tmp_path / "buf" / "embeddings.npy")
    assert emb.shape == (12, 1024) and np.allclose(emb, bow_encode([r["key"] for r in rows]))
    # min_reward drops the wrong one of question b
    m2 = build_trace_buffer(str(tmp_path / "buf2"), ex, sampler, BOW, n=7, k=3, min_reward=1.0, progress=False)
    assert m2["counts"]["trajectories_kept"] == 5 and m2["rewards"]["kept_below_1"] == 0


def test_solver_steps_carry_observations(world, tmp_path):
    w, files = world
    assert parse_question("What is the birthplace of the founder of Zelko?") == ("Zelko", ["founder", "birthplace"])
    solver = NoisySolver(WorldRetriever(w.corpus_rows()), noise=0.0)
    cands = solver(w.train, 2, 0, 0)
    for ex, (c, _) in zip(w.train, cands):  # noise 0: always right, one search per hop
        hops = w.hops(ex.id)
        assert c.response.endswith(f"<answer> {ex.golden_answers[0]} </answer>") and c.num_searches == len(hops)
        for (key, value), (subj, rel, obj) in zip(c.steps, hops):
            assert f"<search> {subj} {rel} </search>" in value and f"The {rel} of {subj} is {obj}." in value
            assert value.rstrip().endswith("</information>")
        assert c.steps[0][0] == f"{ex.question}\n" and c.steps[-1][0] == history_key(ex.question, c.response[
            :c.response.rindex("<think>")])
    noisy = NoisySolver(WorldRetriever(w.corpus_rows()), noise=0.3)
    m = build_trace_buffer(str(tmp_path / "buf"), w.train, noisy, BOW, n=16, k=5, shard_size=4, progress=False)
    rows = [json.loads(line) for line in (tmp_path / "buf" / "steps.jsonl").read_text().splitlines()]
    assert m["counts"]["questions"] == len(w.train) == 9 and m["counts"]["trajectories_kept"] == 45
    assert 0.0 < m["rewards"]["sampled_mean"] < m["rewards"]["kept_mean"]
    # a kept 3-hop success has 3 search steps (each with its observation) and the answer
    q3 = [r for r in rows if r["qid"].startswith("synth_3hop") and r["reward"] == 1.0 and r["rank"] == 0]
    assert [r["kind"] for r in q3[:4]] == ["search", "search", "search", "answer"]
    assert all("<information>Doc 1(Title:" in r["value"] for r in q3[:3])
    assert m["world"]["id"] == questions_fingerprint(w.train)


def test_rollout_sampler_top_k_on_the_rollout_loop(tmp_path):
    from rexrag_jax.rollout.loop import RolloutConfig

    tok = ToyTokenizer()

    def responder(row, ctx, toks):  # rows 1 and 3 of each group answer right, after one search
        if "<information>" not in ctx.split("<|im_start|>assistant\n", 1)[1]:
            return f"<think> r{row} </think><search> find {row % 4} </search>"
        return f"<think> ok </think><answer> {'A' if row % 4 in (1, 3) else 'B'} </answer>"
    ex = [QAExample("0", "q0", ["A"], "nq"), QAExample("1", "q1", ["A"], "nq")]
    sampler = build_cli.RolloutSampler(ScriptedEngine(tok, responder, 8), tok, FakeRetriever(),
                                       RolloutConfig(probes=False, max_turns=2))
    m = build_trace_buffer(str(tmp_path / "b"), ex, sampler, BOW, n=4, k=2, progress=False)
    rows = [json.loads(line) for line in (tmp_path / "b" / "steps.jsonl").read_text().splitlines()]
    assert [(r["qid"], r["sample"], r["kind"]) for r in rows] == [
        ("0", 1, "search"), ("0", 1, "answer"), ("0", 3, "search"), ("0", 3, "answer"),
        ("1", 1, "search"), ("1", 1, "answer"), ("1", 3, "search"), ("1", 3, "answer")]
    s = rows[0]
    assert s["value"].startswith("<think> r1 </think><search> find 1 </search>")
    assert "<information>" in s["value"] and "body of find 1 0" in s["value"] and s["key"] == "q0\n"
    assert rows[1]["key"] == history_key("q0", s["value"]) and m["rewards"]["kept_mean"] == 1.0


def _built(tmp_path, name="buf", **kw):
    ex = [QAExample(str(i), f"question {i}", ["A"], "nq") for i in range(3)]
    build_trace_buffer(str(tmp_path / name), ex, answers("A", "B", "A"), BOW, n=3, k=2, progress=False, **kw)
    return str(tmp_path / name), ex


def test_load_checks_encoder_world_and_empty(tmp_path):
    d, ex = _built(tmp_path)
    buf, m = load_static_buffer(d, BOW, world_id=questions_fingerprint(ex), extra_capacity=10)
    assert len(buf) == 12 and buf.capacity == 22 and buf.query(["question 1"], 1)[0][0]["key"] == "question 1\n"
    with pytest.raises(TraceBufferError, match=r"another encoder: name 'bow-1024' \(buffer\) vs 'all-MiniLM-L6-v2'"):
        load_static_buffer(d, named(bow_encode, "all-MiniLM-L6-v2"))
    with pytest.raises(TraceBufferError, match=r"another encoder: dim 1024 \(buffer\) vs 8"):
        load_static_buffer(d, named(lambda t: np.ones((len(t), 8), np.float32), "bow-1024"))
    other = [QAExample("9", "another question", ["Z"], "nq")]
    with pytest.raises(TraceBufferError, match="built for another world: questions fingerprint"):
        load_static_buffer(d, BOW, world_id=questions_fingerprint(other))
    empty, _ = _built(tmp_path, "empty", min_reward=2.0)  # nothing reaches reward 2: no trajectory kept
    with pytest.raises(TraceBufferError, match="the trace buffer is empty"):
        load_static_buffer(empty, BOW)
    with pytest.raises(TraceBufferError, match="not a finished trace buffer, manifest.json missing"):
        load_static_buffer(str(tmp_path / "nothing"), BOW)


def test_resume_after_an_interrupted_build_is_identical(tmp_path):
    ex = [QAExample(str(i), f"question {i}", ["A"], "nq") for i in range(7)]
    base = answers("B", "A", "A", "C")
    ref = build_trace_buffer(str(tmp_path / "ref"), ex, base, BOW, n=4, k=2, shard_size=2, progress=False)

    calls = []

    def dies_at_third(examples, n, seed, start):
        calls.append(start)
        if len(calls) == 3:
            raise KeyboardInterrupt  # the run is killed while it samples shard 2
        return base(examples, n, seed, start)
    out = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        build_trace_buffer(str(out), ex, dies_at_third, BOW, n=4, k=2, shard_size=2, progress=False)
    shards = out / "shards"
    assert sorted(p.name for p in shards.iterdir()) == ["shard-00000.jsonl", "shard-00000.npy",
                                                        "shard-00001.jsonl", "shard-00001.npy"]
    assert not (out / "manifest.json").exists()
    with pytest.raises(TraceBufferError, match="interrupted: rerun build-trace-buffer to resume"):
        load_static_buffer(str(out), BOW)
    (shards / "shard-00001.jsonl").unlink()      # the last shard lost its .jsonl (killed between the two)
    (shards / ".tmp-x1y2").write_text("half")    # and a temp file of a write in progress is left behind
    calls.clear()

    def counted(examples, n, seed, start):
        calls.append(start)
        return base(examples, n, seed, start)
    got = build_trace_buffer(str(out), ex, counted, BOW, n=4, k=2, shard_size=2, progress=False)
    assert calls == [2, 4, 6]                    # shard 0 skipped; shards 1-3 sampled
    assert (out / "steps.jsonl").read_text() == (tmp_path / "ref" / "steps.jsonl").read_text()
    assert np.array_equal(np.load(out / "embeddings.npy"), np.load(tmp_path / "ref" / "embeddings.npy"))
    strip = lambda m: {k: v for k, v in m.items() if k not in ("build_seconds", "created_unix")}  # noqa: E731
    assert strip(got) == strip(ref) and not shards.exists() and not (out / "build_state.json").exists()


def test_partial_build_with_other_settings_is_refused(tmp_path):
    ex = [QAExample(str(i), f"question {i}", ["A"], "nq") for i in range(4)]

    def dies(examples, n, seed, start):
        if start:
            raise KeyboardInterrupt
        return answers("A", "B", "A")(examples, n, seed, start)
    with pytest.raises(KeyboardInterrupt):
        build_trace_buffer(str(tmp_path / "b"), ex, dies, BOW, n=3, k=2, shard_size=2, progress=False)
    with pytest.raises(TraceBufferError, match=r"partial build with other settings \(k 2 -> 1\); pass --overwrite"):
        build_trace_buffer(str(tmp_path / "b"), ex, answers("A", "B", "A"), BOW, n=3, k=1, shard_size=2,
                           progress=False)
    m = build_trace_buffer(str(tmp_path / "b"), ex, answers("A", "B", "A"), BOW, n=3, k=1, shard_size=2,
                           overwrite=True, progress=False)
    assert m["k"] == 1 and m["count"] == 8


def test_cli_refuses_a_finished_dir_without_overwrite(world, tmp_path, monkeypatch, capsys):
    w, files = world
    monkeypatch.setattr(build_cli, "make_encode_fn", lambda max_length=256: BOW)
    argv = ["--policy", "solver", "--noise", "0.3", "--questions", files["train"], "--corpus", files["corpus"],
            "--lexical", "--out", str(tmp_path / "buf"), "--n", "4", "--k", "2", "--no-progress"]
    assert build_cli.main(argv) == 0
    first = (tmp_path / "buf" / "steps.jsonl").read_text()
    m = json.loads((tmp_path / "buf" / "manifest.json").read_text())
    assert m["policy"] == {"kind": "solver", "noise": 0.3, "topk": 3, "retriever": "lexical"}
    assert m["world"]["questions"] == files["train"] and m["counts"]["questions"] == 9 and m["n"] == 4
    capsys.readouterr()
    assert build_cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "a finished trace buffer is already there" in err and "--overwrite" in err
    assert build_cli.main(argv + ["--overwrite", "--seed", "1"]) == 0
    assert (tmp_path / "buf" / "steps.jsonl").read_text() != first  # rebuilt with another seed
    capsys.readouterr()
    assert build_cli.main(argv[:5] + [str(tmp_path / "missing.jsonl")] + argv[6:] + ["--overwrite"]) == 2
    assert "--questions: file not found" in capsys.readouterr().err
    bad = tmp_path / "nq.jsonl"
    bad.write_text(json.dumps({"id": "1", "question": "Who wrote it?", "golden_answers": ["x"]}) + "\n")
    assert build_cli.main(["--policy", "solver", "--questions", str(bad), "--corpus", files["corpus"], "--lexical",
                           "--out", str(tmp_path / "b2"), "--no-progress"]) == 2
    assert "question 1: not a synthetic-world question" in capsys.readouterr().err


# --- the RAPO trainer on a static buffer ------------------------------------------------------------------
def _trainer(run_dir, buffer_dir, examples, steps=1, **kw):
    import types

    from rexrag_jax.models.qwen2.config import Qwen2Config
    from rexrag_jax.rapo.trace_buffer import TraceBuffer
    from rexrag_jax.rapo.trainer import RapoTrainer
    from rexrag_jax.train.optim import OptimizerConfig
    from rexrag_jax.train.synthetic import SyntheticRollout
    from rexrag_jax.train.trainer import TrainConfig

    src = SyntheticRollout(vocab_size=512, probe_prob=0.0, correct_prob=0.5)
    src.buffer = TraceBuffer(BOW, capacity=64)
    src.tokenizer = types.SimpleNamespace(decode=lambda ids: " ".join(f"w{i}" for i in ids))
    cfg = TrainConfig(seed=0, total_steps=steps, num_questions=2, group_size=4, mini_batch=8, micro_batch=4,
                      max_seq_len=64, length_bucket=32, logprob_chunk=0, eps_low=0.28, eps_high=0.28, kl_coef=0.0,
                      use_probes=False, checkpoint_every=1, keep_checkpoints=2, eval_every=0)
    return RapoTrainer(str(run_dir), model_cfg=Qwen2Config.from_preset("tiny"), rollout=src, config=cfg,
                       optimizer=OptimizerConfig(learning_rate=1e-4, total_steps=steps), train_examples=examples,
                       use_tensorboard=False, trace_buffer_dir=buffer_dir, **kw)


def test_rapo_trainer_uses_the_static_buffer_without_online_filling(tmp_path):
    from rexrag_jax.train.synthetic import synthetic_examples

    examples = synthetic_examples(8)
    d = str(tmp_path / "buf")
    build_trace_buffer(d, examples, answers("A", "B"), BOW, n=2, k=1, progress=False)
    with pytest.raises(TraceBufferError, match="built for another world"):
        _trainer(tmp_path / "r0", d, synthetic_examples(9))
    t = _trainer(tmp_path / "run", d, examples)
    assert not t.online_fill and len(t.rollout.buffer) == 16 and t.rollout.buffer.capacity == 16
    keys = list(t.rollout.buffer.keys)
    assert t.run() == 0
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["rapo/buffer_size"] == 16 and row["rapo/buffer_added"] == 0 and t.rollout.buffer.keys == keys
    assert not (tmp_path / "run" / "trace_buffer").exists()  # a static buffer is not copied into the run
    both = _trainer(tmp_path / "run2", d, examples, online_fill=True)
    assert both.online_fill and both.rollout.buffer.capacity == 16 + 64


def test_rexrag_train_exits_2_on_a_buffer_of_another_encoder(tmp_path, capsys):
    """gin/rapo.gin + tiny bindings, TRACE_BUFFER_DIR = a buffer keyed with another encoder than the
    rollout source's MiniLM: one line on stderr, exit 2, before training."""
    import pathlib

    import gin
    from rexrag_jax.train.main import main
    from rexrag_jax.train.synthetic import synthetic_examples

    d = str(tmp_path / "buf")
    build_trace_buffer(d, synthetic_examples(8), answers("A", "B"), BOW, n=2, k=1, progress=False)
    tiny = pathlib.Path(__file__).resolve().parents[2] / "gin" / "tiny.gin"
    tiny_bindings = [line for line in tiny.read_text().splitlines()
                     if line.strip() and not line.lstrip().startswith(("#", "include"))]
    gin.clear_config()
    try:
        rc = main(["--gin_file", "rapo.gin", "--run_dir", str(tmp_path / "run")]
                  + [a for b in tiny_bindings for a in ("--gin_bindings", b)]
                  + ["--gin_bindings", "Trainer.rollout = @SyntheticHybridRollout()",
                     "--gin_bindings", f"TRACE_BUFFER_DIR = '{d}'"])
    finally:
        gin.clear_config()
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert err[0].startswith("rexrag train: ") and "built with another encoder: name 'bow-1024' (buffer)" in err[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
