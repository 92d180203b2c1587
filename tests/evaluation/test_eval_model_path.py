"""`rexrag eval --data ... --checkpoint ...`: the model-running path end to end (tiny random Qwen2 exported
with hf_io + a tiny SentencePiece tokenizer, MiniLM index over a 50-row wiki-18 slice), the vocabulary
guard against a full forward, and loading a trainer run directory's orbax checkpoint."""
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rexrag_jax.evaluation import main as eval_main
from rexrag_jax.models.qwen2 import model as qwen2
from rexrag_jax.models.qwen2.config import Qwen2Config
from rexrag_jax.evaluation.policy import load_policy, restrict_vocab

FILES = ("nq_test_1k.jsonl", "hotpotqa_dev_500.jsonl")
LIMIT = 3


def _cfg(vocab):
    return Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                       num_kv_heads=1, head_dim=16, rope_theta=10000.0, tie_word_embeddings=True,
                       max_position_embeddings=1024)


@pytest.fixture(scope="module")
def world(shared_data, tmp_path_factory):
    from rexrag_jax.models.qwen2.hf_io import export_checkpoint
    from rexrag_jax.tokenizers import load_tokenizer, train_sentencepiece

    tmp = tmp_path_factory.mktemp("evalmodel")
    rows = (shared_data / "corpus" / "wiki18_sample_1000.jsonl").read_text().splitlines()[:50]
    corpus = tmp / "wiki50.jsonl"
    corpus.write_text("\n".join(rows) + "\n")
    lines = [json.loads(r)["contents"] for r in rows]
    for name in FILES:
        lines += [json.loads(r)["question"] for r in (shared_data / "benchmarks" / name).read_text().splitlines()[:50]]
    spm = train_sentencepiece(lines, tmp / "tok" / "spm", vocab_size=400)
    tok = load_tokenizer(spm)
    cfg = _cfg(tok.vocab_size)
    params = qwen2.init_params(cfg, jax.random.PRNGKey(0))
    model_dir = export_checkpoint(params, cfg, str(tmp / "model"), progress=False)
    shutil.copy(spm, tmp / "model" / "tokenizer.model")
    return dict(tmp=tmp, corpus=corpus, model_dir=model_dir, spm=spm, tok=tok, params=params, cfg=cfg)


def _query(tok, corpus):
    """The first title word (>= 5 letters) whose `<search> w </search>` tokens are all distinct."""
    for row in corpus.read_text().splitlines():
        for w in json.loads(row)["contents"].split("\n")[0].strip('"').split():
            script = tok.encode(f"<search> {w} </search>")
            if len(w) >= 5 and w.isalpha() and len(set(script)) == len(script):
                return w, script
    raise AssertionError("no usable query word")


def _scripted_policy(tok, script):
    """A Qwen2 whose greedy output is `script` after any context: every layer is zero (the residual stream
    is the one-hot embedding of the last token), so logits = sqrt(D) * lm_head[last token]; lm_head sends
    each script token to the next and every other token to the script's first."""
    v = tok.vocab_size
    heads = -(-v // 16)
    cfg = dataclasses_replace(_cfg(v), hidden_size=16 * heads, num_heads=heads, num_kv_heads=1, head_dim=16,
                              intermediate_size=8, tie_word_embeddings=False)
    params = jax.tree.map(jnp.zeros_like, qwen2.init_params(cfg, jax.random.PRNGKey(0)))
    params["embed"] = jnp.eye(v, cfg.hidden_size, dtype=jnp.float32)
    params["final_norm"] = jnp.ones_like(params["final_norm"])
    nxt = np.full(cfg.hidden_size, script[0])
    nxt[script[:-1]] = script[1:]
    params["lm_head"] = jnp.asarray(np.eye(v, dtype=np.float32)[nxt] * 10.0)
    return params, cfg, script


@pytest.fixture(scope="module")
def scripted_model(world):
    from rexrag_jax.models.qwen2.hf_io import export_checkpoint

    query, script = _query(world["tok"], world["corpus"])
    params, cfg, script = _scripted_policy(world["tok"], script)
    d = export_checkpoint(params, cfg, str(world["tmp"] / "scripted"), progress=False)
    shutil.copy(world["spm"], world["tmp"] / "scripted" / "tokenizer.model")
    return d, query, script


def _expected_response(tok, retriever, query, script, max_obs_tokens=500):
    """turn 0 searches `query`, the observation is appended (cut to max_obs_tokens), the final turn (search
    disabled) repeats the search and ends the row."""
    from rexrag_jax.rollout import format_observation

    obs = tok.encode(format_observation(retriever.search([query], 3)[0]))[:max_obs_tokens]
    return tok.decode(script + obs + script)


def test_eval_cli_runs_the_model(world, scripted_model, shared_data, capsys):
    from rexrag_jax.retrieval import build_default_retriever
    from rexrag_jax.retrieval.server import running_server

    model_dir, query, script = scripted_model
    files = [str(shared_data / "benchmarks" / n) for n in FILES]
    common = ["--data", *files, "--limit", str(LIMIT), "--checkpoint", model_dir, "--max-turns", "1",
              "--max-new-tokens", "16", "--max-context", "1000", "--batch-size", "8", "--no-progress"]
    out = world["tmp"] / "traj.jsonl"
    index_dir = world["tmp"] / "index"
    argv = common + ["--corpus", str(world["corpus"]), "--index-dir", str(index_dir), "--out", str(out)]
    assert eval_main.main(argv) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    table = printed.splitlines()
    assert table[0].split()[:5] == ["source", "nq", "triviaqa", "popqa", "hotpotqa"]
    n_row = next(line for line in table if line.startswith("n")).split()
    assert n_row[1] == str(LIMIT) and n_row[4] == str(LIMIT) and n_row[-1] == str(2 * LIMIT)
    assert n_row[2] == n_row[3] == "-"
    assert f"wrote {2 * LIMIT} trajectories" in printed
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(recs) == 2 * LIMIT
    assert [r["data_source"] for r in recs] == ["nq"] * LIMIT + ["hotpotqa"] * LIMIT
    expected_ids = [json.loads(r)["id"] for r in (shared_data / "benchmarks" / FILES[0]).read_text().splitlines()[:LIMIT]]
    assert [r["id"] for r in recs[:LIMIT]] == expected_ids
    # the in-process retriever over the 50-row slice was queried with the policy's search
    local = build_default_retriever(str(world["corpus"]), str(index_dir))
    expected = _expected_response(world["tok"], local, query, script)
    assert "<information>Doc 1(Title:" in expected
    assert all(r["response"] == expected and r["prediction"] is None and r["em"] == 0.0 for r in recs)

    # the same run through a Search-R1 HTTP server gives the same trajectories
    out_http = world["tmp"] / "traj_http.jsonl"
    with running_server(local) as url:
        assert eval_main.main(common + ["--retriever-url", url + "/retrieve", "--out", str(out_http)]) == 0
    capsys.readouterr()
    assert [json.loads(line) for line in out_http.read_text().splitlines()] == recs


def test_greedy_responses_match_a_plain_forward_decode(world):
    """First turn of the eval rollout == greedy decoding by repeated full forwards (no cache)."""
    from rexrag_jax.data.prompts import render_prompt
    from rexrag_jax.data.schema import QAExample
    from rexrag_jax.evaluation.policy import make_eval_generate_fn

    class NoRetriever:
        def search(self, queries, topk):
            return [[] for _ in queries]

    fn = make_eval_generate_fn(world["model_dir"], max_turns=0, max_new_tokens=6, max_context=200, batch_size=2,
                               retriever=NoRetriever(), progress=False)
    ex = QAExample("x", "who wrote hamlet", ["shakespeare"], "nq")
    resp = fn([ex])[0]
    tok, cfg, params = world["tok"], world["cfg"], world["params"]
    ids = tok.encode(render_prompt(tok, ex.question))
    gen = []
    for _ in range(6):
        logits, _ = qwen2.forward(params, jnp.asarray([ids + gen]), cfg)
        gen.append(int(jnp.argmax(logits[0, -1])))
        if gen[-1] in tok.eos_ids:
            break
    expected = tok.decode(gen)
    # the engine cuts right after a stop string; a random model is unlikely to emit one in 6 tokens
    assert resp == expected


def test_restrict_vocab_is_the_masked_distribution():
    cfg = dataclasses_replace(_cfg(96), tie_word_embeddings=False)
    params = qwen2.init_params(cfg, jax.random.PRNGKey(1))
    small_params, small_cfg = restrict_vocab(params, cfg, 80)
    assert small_cfg.vocab_size == 80 and small_params["lm_head"].shape == (32, 80)
    tokens = jnp.asarray([[1, 5, 79, 3]])
    full, _ = qwen2.forward(params, tokens, cfg)
    cut, _ = qwen2.forward(small_params, tokens, small_cfg)
    np.testing.assert_allclose(cut, full[..., :80], rtol=1e-5, atol=1e-5)
    masked = jnp.where(jnp.arange(96) < 80, full, -jnp.inf)
    np.testing.assert_allclose(jax.nn.log_softmax(cut), jax.nn.log_softmax(masked)[..., :80], rtol=1e-5, atol=1e-5)
    assert restrict_vocab(params, cfg, 96)[1] is cfg
    with pytest.raises(ValueError, match="tokenizer vocab 97 > model vocab 96"):
        restrict_vocab(params, cfg, 97)


def dataclasses_replace(cfg, **kw):
    import dataclasses
    return dataclasses.replace(cfg, **kw)


def test_load_policy_from_a_trainer_run_dir(world, tmp_path):
    """A `rexrag train` run dir: model from its gin, tokenizer from TOKENIZER, params from orbax; the tiny
    preset's 512-row vocab is cut to the tokenizer's."""
    import gin

    from rexrag_jax.models.qwen2.config import model_config
    from rexrag_jax.train.checkpoint import Checkpointer
    from rexrag_jax.train.optim import OptimizerConfig

    gin.clear_config()
    cfg = Qwen2Config.from_preset("tiny")
    params = qwen2.init_params(cfg, jax.random.PRNGKey(2))
    ckpt = Checkpointer(str(tmp_path / "run" / "checkpoints"))
    ckpt.save(3, {"params": params, "opt_state": OptimizerConfig().make().init(params)}, {"step": 3})
    ckpt.close()
    (tmp_path / "run" / "operative_config.gin").write_text(
        f'TOKENIZER = "{world["spm"]}"\nmodel_config.preset = "tiny"\nSearchRollout.tokenizer_path = %TOKENIZER\n')
    try:
        got_cfg, got, tok = load_policy(str(tmp_path / "run"), progress=False)
    finally:
        gin.clear_config()
    assert model_config is not None and tok.vocab_size == world["tok"].vocab_size < 512
    assert got_cfg.vocab_size == tok.vocab_size and got_cfg.hidden_size == cfg.hidden_size
    np.testing.assert_array_equal(got["embed"], params["embed"][:tok.vocab_size])
    np.testing.assert_array_equal(got["layers"]["q_kernel"], params["layers"]["q_kernel"])


def test_missing_retriever_is_a_clear_error(world, shared_data, capsys):
    rc = eval_main.main(["--data", str(shared_data / "benchmarks" / "bamboogle_test.jsonl"), "--limit", "1",
                         "--checkpoint", world["model_dir"], "--no-progress"])
    assert rc == 2 and "--retriever-url URL" in capsys.readouterr().err


def _scripted_run_dir(world, scripted_model, run_dir, rollout_cfg):
    """A trainer run dir holding the scripted policy: orbax checkpoint 1 + the Trainer's policy.json (no gin)."""
    import dataclasses
    import types

    from rexrag_jax.train.checkpoint import Checkpointer
    from rexrag_jax.train.optim import OptimizerConfig
    from rexrag_jax.train.trainer import write_policy_record

    _, query, script = scripted_model
    params, cfg, _ = _scripted_policy(world["tok"], script)
    ckpt = Checkpointer(str(run_dir / "checkpoints"))
    ckpt.save(1, {"params": params, "opt_state": OptimizerConfig().make().init(params)}, {"step": 1})
    ckpt.close()
    write_policy_record(str(run_dir), cfg, types.SimpleNamespace(tokenizer_path=world["spm"], config=rollout_cfg))
    rec = json.loads((run_dir / "policy.json").read_text())
    assert rec["model_config"] == dataclasses.asdict(cfg) and rec["rollout"]["topk"] == rollout_cfg.topk
    return query, script


def test_eval_of_a_run_dir_takes_the_rollout_settings_it_trained_with(world, scripted_model, shared_data,
                                                                    tmp_path, capsys):
    """`rexrag eval --checkpoint RUN` with no rollout flags: top-k 2, 1 turn, 16 tokens, context 1000 and
    40 observation tokens from the run's policy.json (a demo run dir RUN/rl works the same); an explicit
    flag still wins."""
    from rexrag_jax.retrieval import build_default_retriever
    from rexrag_jax.rollout import RolloutConfig

    demo = tmp_path / "demo"
    query, script = _scripted_run_dir(world, scripted_model, demo / "rl",
                                      RolloutConfig(max_turns=1, max_new_tokens=16, max_context=1000, topk=2,
                                                    max_obs_tokens=40))
    index_dir = world["tmp"] / "index_settings"
    out = tmp_path / "traj.jsonl"
    base = ["--data", str(shared_data / "benchmarks" / FILES[0]), "--limit", "2", "--batch-size", "2",
            "--corpus", str(world["corpus"]), "--index-dir", str(index_dir), "--no-progress", "--out", str(out)]
    for ckpt in (demo / "rl", demo):  # the trainer run dir, and the demo run dir above it
        assert eval_main.main(base + ["--checkpoint", str(ckpt)]) == 0
        err = capsys.readouterr().err
        assert ("rollout settings: topk 2 (run), max_turns 1 (run), max_new_tokens 16 (run), max_context 1000 (run), "
                "max_obs_tokens 40 (run)") in err
        local = build_default_retriever(str(world["corpus"]), str(index_dir))
        from rexrag_jax.rollout import format_observation
        expected = _expected_response(world["tok"], local, query, script, max_obs_tokens=40)
        assert expected != _expected_response(world["tok"], local, query, script)  # the paper's 500 differ
        assert all(json.loads(l)["response"] == expected for l in out.read_text().splitlines())
    assert eval_main.main(base + ["--checkpoint", str(demo), "--max-turns", "2"]) == 0
    assert "topk 2 (run), max_turns 2 (flag), max_new_tokens 16 (run)" in capsys.readouterr().err
    two_turns = [json.loads(l)["response"] for l in out.read_text().splitlines()]
    assert all(r.startswith(expected[:-len(world["tok"].decode(script))]) and r != expected for r in two_turns)


def test_context_beyond_the_model_positions_is_refused(world, scripted_model, shared_data, tmp_path, capsys):
    from rexrag_jax.rollout import RolloutConfig

    run = tmp_path / "run"
    _scripted_run_dir(world, scripted_model, run, RolloutConfig(max_turns=1, max_new_tokens=16, max_context=1000))
    rc = eval_main.main(["--data", str(shared_data / "benchmarks" / FILES[0]), "--limit", "1",
                         "--corpus", str(world["corpus"]), "--index-dir", str(world["tmp"] / "index_settings"),
                         "--checkpoint", str(run), "--max-context", "4096", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0, err
    assert "--max-context 4096 + --max-new-tokens 16 = 4112 positions" in err
    assert "max_position_embeddings 1024" in err
