"""Host-side batch assembly (prepare.py), synthetic rollouts and the gin run types; no model compiles."""
import pathlib

import gin
import numpy as np
import pytest

from rexrag_jax.rl.filtering import num_probes_to_keep
from rexrag_jax.rollout.types import SEG_PROBE, SEG_RESPONSE
from rexrag_jax.train import prepare
from rexrag_jax.train.synthetic import synthetic_batch, synthetic_examples, synthetic_pool
from rexrag_jax.train.trainer import step_seed

EXAMPLES = synthetic_examples(6)
POOL = synthetic_pool(512)


def _batch(seed=3, **kw):
    return synthetic_batch(EXAMPLES, 4, 512, seed, POOL, probe_prob=1.0, **kw)


def test_synthetic_batch_layout_and_determinism():
    b = _batch()
    assert b.is_probe.any() and (~b.is_probe).sum() == 24
    for i in np.flatnonzero(b.is_probe):
        s, n = b.probe_start[i], b.probe_len[i]
        assert (b.segments[i, s:s + n] == SEG_PROBE).all() and b.loss_mask[i, s:s + n].all()
        assert list(b.tokens[i, s:s + n]) in [list(p) for p in POOL]
        assert (b.segments[i, s + n:b.lengths[i]] == SEG_RESPONSE).all()
    again = _batch()
    np.testing.assert_array_equal(again.tokens, b.tokens)
    assert again.response_text == b.response_text
    assert not np.array_equal(_batch(seed=4).tokens[:, :8], b.tokens[:, :8])


def test_score_reads_the_last_answer():
    b = _batch()
    rewards, correct = prepare.score(b)
    expect = [float(f"<answer> {ex.golden_answers[0]} </answer>" in t) for t, ex in zip(b.response_text, b.examples)]
    np.testing.assert_array_equal(rewards, expect)
    np.testing.assert_array_equal(correct, expect)
    shaped, correct2 = prepare.score(b, structure_format_score=0.1)
    np.testing.assert_array_equal(correct2, correct)
    assert (shaped >= rewards).all() and (shaped > rewards).any()


def test_filter_keeps_all_originals_and_the_best_probes():
    b = _batch()
    rng = np.random.default_rng(0)
    old = rng.normal(size=b.tokens.shape).astype(np.float32)
    rho = 0.1
    keep, kept = prepare.filter_probes(b, old, rho, num_questions=6, group_size=4, dp_size=2)
    probes = np.flatnonzero(b.is_probe)
    k = num_probes_to_keep(6, 4, rho, len(probes), 2)
    assert len(kept) == k and k % 2 == 0 and k > 0
    np.testing.assert_array_equal(keep[:24], np.flatnonzero(~b.is_probe))
    # Brute force: mean old log-prob of each probe's inserted tokens, highest first.
    score = {i: old[i, b.probe_start[i]:b.probe_start[i] + b.probe_len[i]].mean() for i in probes}
    best = sorted(probes, key=lambda i: -score[i])[:k]
    assert list(kept) == best


def test_mini_batches_pad_with_empty_rows_and_keep_every_row_once():
    n, t = 11, 5
    arrays = {"x": np.arange(n * t).reshape(n, t).astype(np.int32) + 1, "loss_mask": np.ones((n, t), bool)}
    mbs = prepare.mini_batches(arrays, mini_batch=4, micro_batch=2, rng=np.random.default_rng(0))
    assert len(mbs) == 3 and all(m["x"].shape == (2, 2, t) for m in mbs)
    rows = np.concatenate([m["x"].reshape(-1, t) for m in mbs])
    mask = np.concatenate([m["loss_mask"].reshape(-1, t) for m in mbs])
    real = rows[mask.any(1)]
    assert sorted(real[:, 0].tolist()) == sorted(arrays["x"][:, 0].tolist())
    assert mask.sum() == n * t and (rows[~mask.any(1)] == 0).all()
    with pytest.raises(ValueError, match="multiple of micro_batch"):
        prepare.mini_batches(arrays, 5, 2, None)


def test_fit_length_buckets_and_truncates():
    b = _batch()
    longest = int(b.lengths.max())
    fitted, cut = prepare.fit_length(b, bucket=16, max_len=128)
    assert fitted.tokens.shape[1] == -(-longest // 16) * 16 and cut == 0
    short, cut = prepare.fit_length(b, bucket=16, max_len=16)
    assert short.tokens.shape[1] == 16 and cut == int((b.lengths > 16).sum()) > 0


def test_rowwise_pads_the_last_chunk_and_drops_its_rows():
    calls = []

    def fn(x):
        calls.append(x.shape)
        return (x * 2, None)

    out, none = prepare.rowwise(fn, (np.arange(10).reshape(5, 2),), rows=2)
    assert calls == [(2, 2)] * 3 and none is None
    np.testing.assert_array_equal(out, np.arange(10).reshape(5, 2) * 2)


def test_step_seed_depends_on_seed_and_step():
    assert step_seed(0, 5) == step_seed(0, 5)
    assert len({step_seed(s, k) for s in range(3) for k in range(50)}) == 150


GIN = pathlib.Path(__file__).resolve().parents[2] / "gin"


@pytest.fixture
def clean_gin():
    gin.clear_config()
    yield
    gin.clear_config()


def _parse(files, bindings=()):
    from rexrag_jax.train.main import parse_gin
    parse_gin(files, list(bindings))


def test_rexrag_gin_holds_the_reference_hyperparameters(clean_gin):
    from rexrag_jax.models.qwen2.config import model_config
    from rexrag_jax.rollout.loop import RolloutConfig
    from rexrag_jax.train.optim import OptimizerConfig
    from rexrag_jax.train.trainer import TrainConfig

    _parse(["rexrag.gin", "model/qwen2.5-3b.gin"])
    t, o, r = TrainConfig(), OptimizerConfig(), RolloutConfig()
    assert (t.total_steps, t.num_questions, t.group_size, t.mini_batch, t.ppo_epochs) == (1005, 512, 5, 256, 1)
    assert gin.query_parameter("%ROLLOUT_BATCH") == t.rollout_batch == 2560
    assert (t.kl_coef, t.eps_low, t.eps_high, t.temperature, t.eval_every, t.checkpoint_every) == \
        (0.001, 0.2, 0.2, 1.0, 150, 50)
    assert t.use_probes and t.initial_keep_ratio == 0.08 and t.keep_ratio_decay == 0.9
    assert (o.learning_rate, o.weight_decay, o.max_grad_norm, o.warmup_steps) == (1e-6, 0.01, 1.0, 286)
    assert (r.max_turns, r.max_new_tokens, r.topk, r.revision_prob, r.probes) == (5, 500, 3, 0.2, True)
    cfg = model_config()
    assert (cfg.num_layers, cfg.hidden_size, cfg.dtype) == (36, 2048, "bfloat16")
    for macro in ("MODEL_PRESET", "MAX_SEQ_LEN", "ROLLOUT_BATCH", "MINI_BATCH", "MICRO_BATCH", "LOGPROB_CHUNK",
                  "KL_COEF"):
        gin.query_parameter(f"%{macro}")
    assert t.logprob_chunk == gin.query_parameter("%LOGPROB_CHUNK") == 512


def test_grpo_gin_turns_probes_off(clean_gin):
    from rexrag_jax.rollout.loop import RolloutConfig
    from rexrag_jax.train.trainer import TrainConfig

    _parse(["grpo.gin", "model/qwen2.5-7b.gin"])
    assert not TrainConfig().use_probes and not RolloutConfig().probes
    assert gin.query_parameter("%MODEL_PRESET") == "qwen2.5-7b"


def test_rollout_batch_must_match_questions_times_group(clean_gin):
    from rexrag_jax.train.trainer import TrainConfig

    with pytest.raises(ValueError, match="ROLLOUT_BATCH"):
        TrainConfig(num_questions=4, group_size=3, rollout_batch=4)
    assert TrainConfig(num_questions=4, group_size=3, rollout_batch=12).rollout_batch == 12


def test_missing_required_macros_are_reported(clean_gin, capsys):
    from rexrag_jax.train.main import main, unset_required_macros

    _parse(["rexrag.gin", "model/qwen2.5-0.5b.gin"], ['TOKENIZER = "/tok"'])
    assert unset_required_macros() == ["INIT_CHECKPOINT", "RETRIEVER_URL", "TRAIN_FILES"]
    gin.clear_config()
    assert main(["--gin_file", "rexrag.gin", "--run_dir", "/tmp/never-created-run"]) == 2
    err = capsys.readouterr().err
    assert "MODEL_PRESET" in err and "TRAIN_FILES" in err and "--gin_bindings" in err
    assert not pathlib.Path("/tmp/never-created-run").exists()


def test_validation_reports_em_per_data_source(tmp_path):
    from rexrag_jax.models.qwen2.config import Qwen2Config
    from rexrag_jax.train.synthetic import SyntheticRollout
    from rexrag_jax.train.trainer import TrainConfig, Trainer

    val = synthetic_examples(8, prefix="v")  # sources alternate nq, hotpotqa; even indices answered right
    cfg = TrainConfig(total_steps=1, num_questions=2, group_size=2, mini_batch=4, micro_batch=2, kl_coef=0.0)
    trainer = Trainer(str(tmp_path), model_cfg=Qwen2Config.from_preset("tiny"), rollout=SyntheticRollout(),
                      config=cfg, train_examples=synthetic_examples(4), val_examples=val, use_tensorboard=False)
    m = trainer.validate()
    assert m == {"val/em_hotpotqa": 0.0, "val/em_nq": 1.0, "val/em_mean": 0.5}
    trainer.ckpt.close()


def test_start_ratio_diagnostics_by_token_kind_hand_computed():
    # row 0: original, 3 loss tokens; row 1: probe, prefix at 0-1, prompt at 2-3, continuation at 4-5
    old = np.log(np.array([[0.5, 0.5, 0.5, 0.0, 0.0, 0.0],
                           [0.4, 0.4, 0.01, 0.02, 0.6, 0.6]]))
    beh = np.log(np.array([[0.4, 0.4, 0.4, 1.0, 1.0, 1.0],
                           [0.8, 0.8, 0.1, 0.1, 0.6, 0.3]]))
    mask = np.array([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]], bool)
    d = prepare.start_ratio_diagnostics(old, beh, mask, np.array([False, True]), np.array([0, 2]),
                                        np.array([0, 2]), np.array([-0.5, 2.0]))
    assert d["ratio0/original"] == pytest.approx(1.25)
    assert d["ratio0/probe_prefix"] == pytest.approx(0.5)
    assert d["ratio0/probe_prompt"] == pytest.approx((0.1 + 0.2) / 2)
    assert d["ratio0/probe_prompt_first"] == pytest.approx(0.1)
    assert d["ratio0/probe_continuation"] == pytest.approx((1.0 + 2.0) / 2)
    # A = 2 on the prompt, weight A·min(r, 1.2): (2·0.1 + 2·0.2) / 2
    assert d["ratio0/prompt_pos_weight"] == pytest.approx(0.3)
    # no probes: the probe kinds are NaN, the original's ratio is still reported
    d0 = prepare.start_ratio_diagnostics(old[:1], beh[:1], mask[:1], np.array([False]), np.array([0]),
                                         np.array([0]), np.array([1.0]))
    assert d0["ratio0/original"] == pytest.approx(1.25) and np.isnan(d0["ratio0/probe_prompt"])
    assert np.isnan(d0["ratio0/prompt_pos_weight"])
