"""RapoTrainer on a tiny Qwen2 with a synthetic hybrid rollout source: steps run, RAPO metrics are
logged, successful steps enter the buffer, the buffer is checkpointed and restored; gin/rapo.gin binds
the RAPO hyperparameters."""
import json
import types

import numpy as np
import pytest

from rexrag_jax.models.qwen2.config import Qwen2Config
from rexrag_jax.rapo.trace_buffer import SEG_RETRIEVED, TraceBuffer
from rexrag_jax.rapo.trainer import RapoTrainer
from rexrag_jax.rollout.types import SEG_RESPONSE
from rexrag_jax.train.optim import OptimizerConfig
from rexrag_jax.train.synthetic import SyntheticRollout, synthetic_examples
from rexrag_jax.train.trainer import TrainConfig
from rapo_fakes import bow_encode


class FakeHybridSource(SyntheticRollout):
    """Synthetic rollouts where the first two response tokens of every other row were 'inserted'."""

    def __init__(self):
        super().__init__(vocab_size=512, probe_prob=0.0, correct_prob=0.5)
        self.buffer = TraceBuffer(bow_encode, capacity=64, searcher="exact")
        self.tokenizer = types.SimpleNamespace(decode=lambda ids: " ".join(f"w{i}" for i in ids))

    def __call__(self, params, examples, group_size, seed, use_probes=False):
        batch, stats = super().__call__(params, examples, group_size, seed, False)
        for n in range(0, batch.size, 2):
            batch.segments[n, np.flatnonzero(batch.segments[n] == SEG_RESPONSE)[:2]] = SEG_RETRIEVED
        batch.loss_mask = batch.segments == SEG_RESPONSE
        return batch, stats


def make(run_dir, steps=2, **overrides):
    cfg = dict(seed=0, total_steps=steps, num_questions=2, group_size=4, mini_batch=8, micro_batch=4, max_seq_len=64,
               length_bucket=32, logprob_chunk=0, eps_low=0.28, eps_high=0.28, kl_coef=0.0, use_probes=False,
               checkpoint_every=1, keep_checkpoints=2, eval_every=0)
    cfg.update(overrides)
    return RapoTrainer(str(run_dir), model_cfg=Qwen2Config.from_preset("tiny"), rollout=FakeHybridSource(),
                       config=TrainConfig(**cfg), optimizer=OptimizerConfig(learning_rate=1e-4, total_steps=steps),
                       train_examples=synthetic_examples(16), use_tensorboard=False)


def test_rapo_trainer_steps_buffer_and_resume(tmp_path):
    trainer = make(tmp_path)
    assert trainer.ref_params is None  # β = 0: no reference pass
    assert trainer.run() == 0
    rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rapo/hybrid_rows"] == 4 and r["rapo/inserted_tokens"] == 8 and r["skipped_updates"] == 0
        assert 0 <= r["rapo/inserted_fraction_mean"] < 1 and np.isfinite(r["loss"])
        assert r["rapo/insertions_per_hybrid_traj"] == 1.0 and r["rapo/insertions_per_traj"] == 0.5
        for k in ("rapo/z_ret_mean", "rapo/z_ret_std", "rapo/a_ret_std", "rapo/f_ret_mean",
                  "rapo/shaped_ratio_clip_frac", "searches/mean"):
            assert np.isfinite(r[k]), k
        assert r["all/ratio_max"] <= 1.05 + 1e-3  # on-policy ratio 1, shaped by at most (1 + 0.05 F)
    buf = trainer.rollout.buffer
    assert len(buf) == rows[-1]["rapo/buffer_size"] == rows[0]["rapo/buffer_added"] + rows[1]["rapo/buffer_added"] > 0
    assert sorted(p.name for p in (tmp_path / "trace_buffer").iterdir()) == ["1", "2"]

    resumed = make(tmp_path, steps=3)
    assert len(resumed.rollout.buffer) == 0
    assert resumed.maybe_restore() and resumed.step == 2
    assert resumed.rollout.buffer.keys == buf.keys and resumed.rollout.buffer.values == buf.values


def test_rapo_trainer_rejects_grpo_hyperparameters(tmp_path):
    with pytest.raises(ValueError, match=r"eps_low=0.2, eps_high=0.28, kl_coef=0.0, use_probes=False; RAPO needs 0.28"):
        make(tmp_path, eps_low=0.2)


def test_gin_rapo_binds_hyperparameters():
    import gin
    from rexrag_jax.rapo.hook import RapoConfig
    from rexrag_jax.rapo.hybrid_rollout import HybridConfig
    from rexrag_jax.train.main import parse_gin
    gin.clear_config()
    try:
        parse_gin(["rapo.gin"], ['TOKENIZER = "t"', 'RETRIEVER_URL = "u"', 'MODEL_PRESET = "tiny"',
                                 'TRAIN_FILES = []', 'INIT_CHECKPOINT = None'])
        tc, rc, hc = TrainConfig(), RapoConfig(), HybridConfig()
        assert (tc.eps_low, tc.eps_high, tc.kl_coef, tc.use_probes) == (0.28, 0.28, 0.0, False)
        assert (rc.ret_adv_coef, rc.ratio_coef, rc.clip_eps, rc.kl_coef) == (0.2, 0.05, 0.28, 0.0)
        assert hc.insert_prob == 0.5 and hc.num_hybrid == 8 and "<retrieve>" in hc.prompt_note
        assert (tc.num_questions, tc.group_size, tc.rollout_batch, tc.mini_batch) == (32, 16, 512, 256)
        assert rc.aggregation == "seq_mean"
        assert "@HybridSearchRollout()" in gin.config_str() and "RapoTrainer.rapo = @RapoConfig()" in gin.config_str()
    finally:
        gin.clear_config()


def test_rapo_entry_point_runs_tiny_gin(tmp_path):
    """`rexrag train` with rapo.gin + the tiny run's bindings (tiny.gin minus its `include 'rexrag.gin'`,
    which would reset the RAPO hyperparameters): rapo.gin's `run_type.trainer` makes it a RapoTrainer run."""
    import pathlib
    import gin
    import rexrag_jax.train.trainer as trainer_mod
    from rexrag_jax.train.main import main
    tiny = pathlib.Path(__file__).resolve().parents[2] / "gin" / "tiny.gin"
    tiny_bindings = [line for line in tiny.read_text().splitlines()
                     if line.strip() and not line.lstrip().startswith(("#", "include"))]
    gin.clear_config()
    try:
        rc = main(["--gin_file", "rapo.gin", "--run_dir", str(tmp_path)]
                  + [a for b in tiny_bindings for a in ("--gin_bindings", b)]
                  + ["--gin_bindings", "Trainer.rollout = @SyntheticHybridRollout()",
                   "--gin_bindings", "SyntheticHybridRollout.insert_prob = 0.5",
                   "--gin_bindings", "TOTAL_STEPS = 2", "--gin_bindings", "TrainConfig.checkpoint_every = 2"])
    finally:
        gin.clear_config()
    assert rc == 0 and trainer_mod.Trainer.__name__ == "Trainer"  # nothing patched
    rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all("rapo/retrieval_reward_mean" in r for r in rows)
    assert rows[0]["rapo/inserted_tokens"] > 0 and rows[0]["rapo/hybrid_rows"] <= rows[0]["batch/trajectories"] // 2
    assert (tmp_path / "trace_buffer" / "2" / "entries.json").exists()
    operative = (tmp_path / "operative_config.gin").read_text()
    assert "RAPO_CLIP_EPS = 0.28" in operative and "RapoTrainer.rapo = @RapoConfig()" in operative
    assert "run_type.trainer = @RapoTrainer" in operative


def test_rapo_trainer_rejects_more_hybrid_rows_than_the_group(tmp_path):
    from rexrag_jax.rapo.hybrid_rollout import HybridConfig
    src = FakeHybridSource()
    src.hybrid = HybridConfig(num_hybrid=8)  # gin/rapo.gin's NUM_HYBRID with a miniature group of 4
    with pytest.raises(ValueError, match="num_hybrid=8 > group_size=4.*bind NUM_HYBRID with GROUP_SIZE"):
        RapoTrainer(str(tmp_path), model_cfg=Qwen2Config.from_preset("tiny"), rollout=src,
                    config=TrainConfig(num_questions=2, group_size=4, mini_batch=8, micro_batch=4, eps_low=0.28,
                                       eps_high=0.28, kl_coef=0.0, use_probes=False),
                    train_examples=synthetic_examples(16), use_tensorboard=False)
