"""Packed log-prob / update passes (train/packing.py) against the unpacked (right-padded) ones."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rexrag_jax.models.qwen2 import model as qwen2
from rexrag_jax.models.qwen2.config import Qwen2Config
from rexrag_jax.train import packing, prepare
from rexrag_jax.train.optim import OptimizerConfig
from rexrag_jax.train.update import (LossConfig, logprobs_and_entropy, make_packed_update_fns, make_update_fn,
                                     packed_update, policy_logprobs, zero_acc)

TOL = 1e-5


@pytest.fixture(scope="module")
def setup():
    cfg = Qwen2Config.from_preset("tiny")
    params = qwen2.init_params(cfg, jax.random.PRNGKey(0), std=0.2)  # large init: far from uniform outputs
    rng = np.random.default_rng(0)
    lengths = np.array([13, 5, 29, 9, 17, 3, 24, 11])
    T = 32
    tokens = np.zeros((len(lengths), T), np.int32)
    mask = np.arange(T)[None, :] < lengths[:, None]
    tokens[mask] = rng.integers(1, cfg.vocab_size, int(mask.sum()))
    return cfg, params, tokens, mask, lengths


def test_first_fit_decreasing_and_layout():
    plan = packing.plan_packing([5, 3, 7, 2, 4], pack_len=8)
    # decreasing: 7 -> row0; 5 -> row1; 4 -> row2; 3 -> row1 (5+3); 2 -> row2 (4+2)
    assert plan.row.tolist() == [1, 1, 0, 2, 2]
    assert plan.offset.tolist() == [0, 5, 0, 4, 0]
    assert plan.num_rows == 3
    assert packing.plan_packing([5, 3, 7, 2, 4], 8, row_multiple=4).num_rows == 4
    seg, pos = packing.segment_ids_and_positions(plan)
    assert seg.tolist() == [[1, 1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 2, 2, 2], [1, 1, 1, 1, 2, 2, 0, 0]]
    assert pos.tolist() == [[0, 1, 2, 3, 4, 5, 6, 0], [0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 3, 0, 1, 0, 0]]
    x = np.arange(5 * 8).reshape(5, 8) + 1
    x = np.where(np.arange(8)[None] < np.array([5, 3, 7, 2, 4])[:, None], x, 0)
    assert (packing.unpack(plan, packing.pack(plan, x), 8) == x).all()
    per_row = packing.pack(plan, np.array([10, 20, 30, 40, 50]))  # broadcast to the segment's tokens
    assert per_row[1].tolist() == [10] * 5 + [20] * 3 and per_row[2].tolist() == [50] * 4 + [40] * 2 + [0, 0]
    with pytest.raises(ValueError, match="exceeds"):
        packing.plan_packing([9], 8)


def test_packed_row_never_attends_across_segments():
    seg = jnp.array([[1, 1, 1, 2, 2, 0]])
    mask = np.asarray(qwen2.training_mask(jnp.ones((1, 6), bool), seg))[0].astype(int)
    expected = [[1, 0, 0, 0, 0, 0],
                [1, 1, 0, 0, 0, 0],
                [1, 1, 1, 0, 0, 0],
                [0, 0, 0, 1, 0, 0],
                [0, 0, 0, 1, 1, 0],
                [0, 0, 0, 0, 0, 1]]
    assert mask.tolist() == expected


def test_changing_one_segment_leaves_the_other_unchanged(setup):
    cfg, params, *_ = setup
    tokens = jnp.array([[5, 6, 7, 8, 9, 10, 11, 0]])
    seg = jnp.array([[1, 1, 1, 2, 2, 2, 2, 0]])
    pos = jnp.array([[0, 1, 2, 0, 1, 2, 3, 0]])
    a, _ = qwen2.forward(params, tokens, cfg, segment_ids=seg, positions=pos)
    b, _ = qwen2.forward(params, tokens.at[0, 4].set(30), cfg, segment_ids=seg, positions=pos)
    c, _ = qwen2.forward(params, tokens.at[0, 0].set(30), cfg, segment_ids=seg, positions=pos)
    assert np.array_equal(a[0, :4], b[0, :4]) and not np.allclose(a[0, 4:7], b[0, 4:7])
    assert np.array_equal(a[0, 3:7], c[0, 3:7]) and not np.allclose(a[0, :3], c[0, :3])


@pytest.mark.parametrize("chunk", [None, 7])
def test_packed_logprobs_equal_unpacked(setup, chunk):
    cfg, params, tokens, mask, lengths = setup
    ref = np.asarray(policy_logprobs(params, tokens, mask, cfg, 0.7, chunk))
    packed, plan = packing.pack_arrays({"tokens": tokens}, lengths, pack_len=32, row_multiple=2)
    assert plan.num_rows < len(lengths)
    got = policy_logprobs(params, packed["tokens"], None, cfg, 0.7, chunk, packed["segment_ids"],
                          packed["positions"])
    got = packing.unpack(plan, np.asarray(got), tokens.shape[1])
    np.testing.assert_allclose(got[mask], ref[mask], atol=TOL, rtol=0)
    assert (got[:, 0] == 0).all()


def test_packed_logprobs_and_entropy_equal_unpacked(setup):
    cfg, params, tokens, mask, lengths = setup
    lp, ent = logprobs_and_entropy(params, tokens, mask, cfg, 1.0, chunk=8)
    packed, plan = packing.pack_arrays({"tokens": tokens}, lengths, pack_len=40)
    plp, pent = logprobs_and_entropy(params, packed["tokens"], None, cfg, 1.0, 8, packed["segment_ids"],
                                     packed["positions"])
    for a, b in ((lp, plp), (ent, pent)):
        np.testing.assert_allclose(packing.unpack(plan, np.asarray(b), 32)[mask], np.asarray(a)[mask], atol=TOL)


def _update_arrays(tokens, mask, seed=1):
    rng = np.random.default_rng(seed)
    n, t = tokens.shape
    loss_mask = mask & (np.arange(t)[None] >= 2) & (rng.random((n, t)) < 0.8)
    return {"tokens": tokens, "attention_mask": mask, "loss_mask": loss_mask,
            "behaviour_logp": np.where(loss_mask, -rng.random((n, t)).astype(np.float32) * 6, 0).astype(np.float32),
            "ref_logp": np.where(loss_mask, -rng.random((n, t)).astype(np.float32) * 6, 0).astype(np.float32),
            "advantages": rng.normal(size=n).astype(np.float32),
            "is_probe": np.array([False, True] * (n // 2))}


def test_packed_loss_gradients_and_update_equal_unpacked(setup):
    cfg, params, tokens, mask, lengths = setup
    arrays = _update_arrays(tokens, mask)
    loss_cfg = LossConfig(kl_coef=0.01, temperature=1.0)
    # Adam's first step is lr·g/(|g|+eps): with the default eps 1e-8 a weight whose gradient is ~0 moves by
    # up to lr on a 1e-8 difference of its gradient (float32 summation order differs between the layouts;
    # seen: 6.7e-5 at lr 1e-3). eps 1e-3 bounds that amplification by lr/eps = 10, so the whole update
    # (clip, Adam, decay, finite guard) is compared at 1e-5; the gradients themselves are compared below.
    opt = OptimizerConfig(learning_rate=1e-2, warmup_fraction=0.0, total_steps=10, eps=1e-3).make()
    copy = lambda t: jax.tree.map(lambda x: jnp.array(x, copy=True), t)  # noqa: E731  (donated below)

    # unpacked: one mini-batch of 8 rows in micro-batches of 2
    mb = prepare.mini_batches(arrays, 8, 2, None)[0]
    update = make_update_fn(cfg, opt, loss_cfg)
    p_ref, _, m_ref = update(copy(params), opt.init(params), {k: jnp.asarray(v) for k, v in mb.items()},
                             jnp.float32(1e-2), jnp.bool_(False))
    moved = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
                for a, b in zip(jax.tree.leaves(p_ref), jax.tree.leaves(params)))
    assert moved > 1e-3  # the update is far above the tolerance
    # packed: same trajectories in rows of 32, 1 row per micro-batch
    mbs = packing.packed_mini_batches(arrays, lengths, 8, 1, 32, None)[0]
    assert len(mbs) < 8 and all(m["tokens"].shape == (1, 32) for m in mbs)
    micro, apply = make_packed_update_fns(cfg, opt, loss_cfg)

    # gradients and loss from the accumulator
    from rexrag_jax.train.update import accumulate_gradients
    g_ref, loss_ref, count_ref, _ = accumulate_gradients(params, {k: jnp.asarray(v) for k, v in mb.items()},
                                                         cfg, loss_cfg)
    acc = zero_acc(params)
    for m in mbs:
        acc, _ = micro(params, acc, {k: jnp.asarray(v) for k, v in m.items()}, jnp.bool_(False))
    g_sum, s_sum, c_sum = acc
    assert int(c_sum) == int(count_ref) == int(arrays["loss_mask"].sum())
    np.testing.assert_allclose(float(s_sum / c_sum), float(loss_ref), atol=TOL)
    for a, b in zip(jax.tree.leaves(g_ref), jax.tree.leaves(g_sum)):
        np.testing.assert_allclose(np.asarray(b) / float(c_sum), np.asarray(a), atol=TOL)

    # the whole update (AdamW step and metrics)
    p_pk, _, m_pk = packed_update(micro, apply, copy(params), opt.init(params), mbs, jnp.float32(1e-2),
                                  jnp.bool_(False))
    for a, b in zip(jax.tree.leaves(p_ref), jax.tree.leaves(p_pk)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=TOL)
    m_ref = jax.device_get(m_ref)
    for k in ("loss", "grad_norm", "all/ratio_mean", "probe/ratio_mean", "original/clip_frac", "all/kl_mean"):
        np.testing.assert_allclose(float(m_pk[k]), float(m_ref[k]), atol=TOL, err_msg=k)
    for k in ("all/tokens", "probe/tokens", "original/tokens", "loss_tokens", "skipped"):
        assert int(m_pk[k]) == int(m_ref[k]), k


def test_packed_poison_skips_the_update(setup):
    cfg, params, tokens, mask, lengths = setup
    arrays = _update_arrays(tokens, mask)
    loss_cfg = LossConfig(kl_coef=0.0)
    arrays.pop("ref_logp")
    opt = OptimizerConfig(learning_rate=1e-2, warmup_fraction=0.0, total_steps=10).make()
    micro, apply = make_packed_update_fns(cfg, opt, loss_cfg)
    mbs = packing.packed_mini_batches(arrays, lengths, 8, 2, 32, None)[0]
    before = jax.tree.map(np.asarray, params)
    p, _, m = packed_update(micro, apply, jax.tree.map(jnp.array, params), opt.init(params), mbs,
                            jnp.float32(1e-2), jnp.bool_(True))
    assert int(m["skipped"]) == 1
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(p)):
        assert np.array_equal(a, np.asarray(b))


def _trainer(tmp_path, pack: bool, name: str):
    from rexrag_jax.train.synthetic import SyntheticRollout, synthetic_examples
    from rexrag_jax.train.trainer import TrainConfig, Trainer
    cfg = TrainConfig(total_steps=2, num_questions=4, group_size=4, mini_batch=16, micro_batch=4, kl_coef=0.001,
                      length_bucket=8, max_seq_len=64, pack_sequences=pack, pack_length=32, pack_rows=2,
                      initial_keep_ratio=1.0, logprob_chunk=0)
    return Trainer(str(tmp_path / name), model_cfg=Qwen2Config.from_preset("tiny"),
                   rollout=SyntheticRollout(vocab_size=256, probe_prob=1.0, correct_prob=0.3), config=cfg,
                   train_examples=synthetic_examples(8), use_tensorboard=False)


def test_trainer_packed_step_equals_unpacked_and_probe_weights_unchanged(tmp_path):
    tr = {pack: _trainer(tmp_path, pack, f"p{int(pack)}") for pack in (False, True)}
    # the importance weights: behaviour log-probs of the kept rows (probes included) from each layout
    seen = {}
    for pack, t in tr.items():
        orig = t._update_inputs

        def spy(batch, *a, _orig=orig, _pack=pack):
            arrays, m = _orig(batch, *a)
            seen[_pack] = arrays
            return arrays, m
        t._update_inputs = spy
    m = {pack: t.train_step() for pack, t in tr.items()}
    a, b = seen[False], seen[True]
    assert a["is_probe"].any()
    assert np.array_equal(a["is_probe"], b["is_probe"]) and np.array_equal(a["loss_mask"], b["loss_mask"])
    probe = a["is_probe"]
    lm = a["loss_mask"]
    np.testing.assert_allclose(b["behaviour_logp"][probe][lm[probe]], a["behaviour_logp"][probe][lm[probe]],
                               atol=TOL)
    np.testing.assert_allclose(b["behaviour_logp"][lm], a["behaviour_logp"][lm], atol=TOL)
    np.testing.assert_allclose(b["ref_logp"][lm], a["ref_logp"][lm], atol=TOL)
    for k in ("loss", "grad_norm", "probe/ratio_mean", "kl", "entropy", "probes/kept"):
        np.testing.assert_allclose(m[True][k], m[False][k], atol=TOL, err_msg=k)
    for x, y in zip(jax.tree.leaves(tr[False].params), jax.tree.leaves(tr[True].params)):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=TOL)
    # token accounting, both layouts
    for pack in (False, True):
        assert m[pack]["tokens/real"] == int(a["attention_mask"].sum())
        assert m[pack]["tokens/padded"] >= m[pack]["tokens/real"]
        assert m[pack]["tokens/padding_frac"] == pytest.approx(1 - m[pack]["tokens/real"] / m[pack]["tokens/padded"])
    assert m[True]["tokens/padded"] < m[False]["tokens/padded"]
    for t in tr.values():
        t.ckpt.close()


def _tb_scalars(path):
    """{tag: [(step, value)]} of the scalar summaries in a TensorBoard event file (TFRecord framing:
    u64 length, u32 crc, payload, u32 crc)."""
    import struct

    from tensorboardX.proto import event_pb2
    out = {}
    data = open(path, "rb").read()
    i = 0
    while i < len(data):
        (n,) = struct.unpack("<Q", data[i:i + 8])
        ev = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
        i += 12 + n + 4
        for v in ev.summary.value:
            if v.HasField("simple_value"):
                out.setdefault(v.tag, []).append((ev.step, v.simple_value))
    return out


def test_trainer_logs_real_and_padded_tokens_to_metrics_and_tensorboard(tmp_path):
    from rexrag_jax.train.metrics_log import read_metrics
    from rexrag_jax.train.synthetic import SyntheticRollout, synthetic_examples
    from rexrag_jax.train.trainer import TrainConfig, Trainer
    cfg = TrainConfig(total_steps=2, num_questions=4, group_size=4, mini_batch=16, micro_batch=4, kl_coef=0.0,
                      length_bucket=8, max_seq_len=64, pack_length=32, pack_rows=2, initial_keep_ratio=1.0)
    tr = Trainer(str(tmp_path), model_cfg=Qwen2Config.from_preset("tiny"),
                 rollout=SyntheticRollout(vocab_size=256, probe_prob=1.0, correct_prob=0.3), config=cfg,
                 train_examples=synthetic_examples(8), use_tensorboard=True)
    assert cfg.pack_sequences  # the default
    real = []
    orig = tr._run_updates

    def spy(arrays, s):
        real.append(int(np.asarray(arrays["attention_mask"]).sum()))  # the real tokens of this step's update
        return orig(arrays, s)
    tr._run_updates = spy
    assert tr.run() == 0
    rows = read_metrics(str(tmp_path))
    (events,) = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
    tb = _tb_scalars(events)
    for step in (1, 2):
        m = rows[step]
        assert m["tokens/real"] == real[step - 1] * cfg.ppo_epochs
        assert m["tokens/real"] <= m["tokens/padded"] and m["tokens/padded"] % 32 == 0  # whole packed rows
        assert m["tokens/logprob_padded"] > 0
        for k in ("tokens/real", "tokens/padded", "tokens/padding_frac", "tokens/logprob_padded"):
            assert (step, pytest.approx(m[k], rel=1e-6)) in tb[k], (k, tb.get(k))
