"""RAPO trainer hook: advantages / ratio shaping / masks by hand, and one update through the project's
update step equal to the gradient of rl.rapo.rapo_token_loss on a tiny Qwen2."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rexrag_jax.data.schema import QAExample
from rexrag_jax.models.qwen2 import model as qwen2
from rexrag_jax.models.qwen2.config import Qwen2Config
from rexrag_jax.rapo.hook import RapoConfig, rapo_train_step, rapo_update_arrays
from rexrag_jax.rapo.trace_buffer import SEG_RETRIEVED
from rexrag_jax.rl import rapo as rapo_math
from rexrag_jax.rollout.types import SEG_RESPONSE, TrajectoryBatch
from rexrag_jax.train.synthetic import synthetic_batch, synthetic_examples, synthetic_pool
from rexrag_jax.train.update import logprobs_and_entropy, make_logprob_fn, make_update_fn, policy_logprobs

P, R, I, N_, PAD = 0, SEG_RESPONSE, 3, SEG_RETRIEVED, 5
SEGS = [[P, P, R, R, N_, N_, I, R, R, PAD],
        [P, R, R, R, PAD, PAD, PAD, PAD, PAD, PAD],
        [P, R, N_, N_, N_, R, PAD, PAD, PAD, PAD],
        [P, N_, N_, R, R, PAD, PAD, PAD, PAD, PAD]]


def hand_batch():
    recs = []
    for n, segs in enumerate(SEGS):
        segs = [s for s in segs if s != PAD]
        recs.append(dict(tokens=list(range(1, len(segs) + 1)), segments=segs, logprobs=[0.0] * len(segs),
                         group_id=n // 2, is_probe=False, probe_start=-1, probe_len=0, num_searches=0,
                         example=QAExample(str(n), "q", ["a"], "nq"), response_text=""))
    return TrajectoryBatch.from_records(recs, pad_id=0, pad_to=10)


def test_update_arrays_by_hand():
    batch = hand_batch()
    ent = np.zeros((4, 10), np.float32)
    ent[0, 2:4], ent[0, 7:9] = [1.0, 2.0], [0.5, 0.5]      # H_before 1.5, H_after 0.5
    ent[2, 1], ent[2, 5] = 0.2, 0.8                         # entropy rose: negative Z
    old = np.random.default_rng(0).normal(size=(4, 10)).astype(np.float32)
    rewards = np.array([1.0, 0.0, 1.0, 0.0], np.float32)
    arrays, stats = rapo_update_arrays(batch, rewards, old, ent)

    # Z = tanh(2 (H_b - H_a) / H_b) H_b; row 3: no policy step before its insertion
    z = np.array([np.tanh(2 * 1.0 / 1.5) * 1.5, 0.0, np.tanh(2 * -0.6 / 0.2) * 0.2, 0.0])
    s = np.sqrt(0.5)                                                            # unbiased std of {x, 0} pairs
    a_acc = np.array([0.5, -0.5, 0.5, -0.5]) / (s + 1e-6)
    a_ret = np.array([z[0] / 2, -z[0] / 2, z[2] / 2, -z[2] / 2]) / (np.array([z[0], z[0], -z[2], -z[2]]) * s + 1e-6)
    np.testing.assert_allclose(arrays["advantages"], (1 + 0.2 * a_ret) * a_acc, rtol=1e-5)
    np.testing.assert_allclose(arrays["advantages"], [(1 + .2 * s) * s, (1 - .2 * s) * -s, (1 - .2 * s) * s,
                                                      (1 + .2 * s) * -s], rtol=1e-4)
    f = np.array([2 / 6, 0.0, 3 / 5, 2 / 4])
    np.testing.assert_allclose(arrays["behaviour_logp"], old - np.log(1 + 0.05 * f)[:, None], rtol=1e-6, atol=1e-6)
    # the update step's ratio exp(logp - behaviour) is the shaped ratio (1 + 0.05 F) r
    logp = old + 0.1
    shaped = np.broadcast_to((1 + 0.05 * f)[:, None] * np.exp(0.1), (4, 10))
    np.testing.assert_allclose(np.exp(logp - arrays["behaviour_logp"]), shaped, rtol=1e-5)
    np.testing.assert_array_equal(arrays["loss_mask"], np.array(SEGS) == R)
    assert stats["rapo/hybrid_rows"] == 3
    assert abs(stats["rapo/retrieval_reward_mean"] - z.mean()) < 1e-6
    assert abs(stats["rapo/z_ret_std"] - z.std()) < 1e-6 and abs(stats["rapo/f_ret_mean"] - f.mean()) < 1e-6
    assert stats["rapo/insertions_per_traj"] == 0.75 and stats["rapo/insertions_per_hybrid_traj"] == 1.0
    # seq_mean (default): 1/|s_i| per row over its policy tokens (4, 3, 2, 2), one count mark per row
    np.testing.assert_allclose(arrays["token_weight"], [1 / 4, 1 / 3, 1 / 2, 1 / 2])
    first = [2, 1, 1, 3]
    np.testing.assert_array_equal(arrays["count_mask"], np.arange(10)[None] == np.array(first)[:, None])
    tm, _ = rapo_update_arrays(batch, rewards, old, ent, RapoConfig(aggregation="token_mean"))
    assert "token_weight" not in tm and "count_mask" not in tm
    wi, _ = rapo_update_arrays(batch, rewards, old, ent, RapoConfig(seq_len_counts_inserted=True))
    np.testing.assert_allclose(wi["token_weight"], [1 / 6, 1 / 3, 1 / 5, 1 / 4])
    with pytest.raises(ValueError, match="aggregation='mean'"):
        RapoConfig(aggregation="mean")
    # F_ret over every token after the prompt (policy, inserted, info): rows have 7, 3, 5, 4 such tokens
    fa, _ = rapo_update_arrays(batch, rewards, old, ent, RapoConfig(f_ret_length="after_prompt"))
    f_all = np.array([2 / 7, 0.0, 3 / 5, 2 / 4])
    np.testing.assert_allclose(fa["behaviour_logp"], old - np.log(1 + 0.05 * f_all)[:, None], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="f_ret_length='all'"):
        RapoConfig(f_ret_length="all")
    with pytest.raises(ValueError, match="expected \\(4,\\), \\(4, 10\\), \\(4, 10\\)"):
        rapo_update_arrays(batch, rewards, old[:, :5], ent)


def test_loss_config_defaults():
    lc = RapoConfig().loss_config()
    assert (lc.eps_low, lc.eps_high, lc.kl_coef) == (0.28, 0.28, 0.0)


@pytest.fixture(scope="module")
def tiny():
    cfg = Qwen2Config.from_preset("tiny")
    params = qwen2.init_params(cfg, jax.random.PRNGKey(0))
    b = synthetic_batch(synthetic_examples(3), 2, cfg.vocab_size, seed=4, pool=synthetic_pool(cfg.vocab_size),
                        probe_prob=0.0, correct_prob=0.5, pad_to=32)
    segs = b.segments.copy()
    for n in range(0, b.size, 2):  # first two response tokens of every other row were "inserted"
        t = np.flatnonzero(segs[n] == R)[:2]
        segs[n, t] = SEG_RETRIEVED
    b.segments, b.loss_mask = segs, (segs == R)
    return cfg, params, b


def _reference_delta(cfg, params, b, rewards, ratio_coef, aggregation="seq_mean"):
    old, ent = logprobs_and_entropy(params, jnp.asarray(b.tokens), jnp.asarray(b.attention_mask), cfg)
    policy, inserted = b.segments == R, b.segments == SEG_RETRIEVED
    z = rapo_math.retrieval_rewards(np.asarray(ent), policy, inserted)
    adv = rapo_math.combined_advantages(rewards, z, b.group_ids)

    def loss(p):
        logp = policy_logprobs(p, jnp.asarray(b.tokens), jnp.asarray(b.attention_mask), cfg)
        s, c, _ = rapo_math.rapo_token_loss(logp, old, adv, b.loss_mask, policy, inserted, ratio_coef=ratio_coef,
                                            aggregation=aggregation)
        return s / c
    return jax.tree.map(lambda g: -np.asarray(g), jax.grad(loss)(params))


@pytest.mark.parametrize("aggregation", ["seq_mean", "token_mean"])
def test_rapo_train_step_equals_rapo_token_loss_gradient(tiny, aggregation):
    cfg, params, b = tiny
    host = jax.tree.map(np.asarray, params)
    opt = optax.identity()  # update = p - lr * g exactly
    rc = RapoConfig(aggregation=aggregation)
    update_fn = make_update_fn(cfg, opt, rc.loss_config())
    logprob_fn = make_logprob_fn(cfg, with_entropy=True)
    new, _, metrics, rewards = rapo_train_step(jax.tree.map(jnp.array, params), opt.init(params), update_fn,
                                               logprob_fn, b, lr=1.0, step_seed=0, mini_batch=b.size + 2,
                                               micro_batch=2, cfg=rc)
    assert metrics["rapo/hybrid_rows"] == (b.size + 1) // 2 and metrics["skipped_updates"] == 0
    assert 0 < rewards.sum() < b.size  # both right and wrong answers: non-zero advantages
    delta = jax.tree.map(lambda a, p: np.asarray(a) - p, new, host)
    ref = _reference_delta(cfg, params, b, rewards, rapo_math.RATIO_SHAPING_COEF, aggregation)
    unshaped = _reference_delta(cfg, params, b, rewards, 0.0, aggregation)
    other = _reference_delta(cfg, params, b, rewards, rapo_math.RATIO_SHAPING_COEF,
                             "token_mean" if aggregation == "seq_mean" else "seq_mean")
    scale = max(float(np.abs(x).max()) for x in jax.tree.leaves(ref))
    assert scale > 1e-4
    for d, r_ in zip(jax.tree.leaves(delta), jax.tree.leaves(ref)):
        np.testing.assert_allclose(d, r_, atol=1e-5 * scale, rtol=1e-3)
    # the shaping and the aggregation are visible: without / with the other, the step differs by more
    for alt in (unshaped, other):
        diff = max(float(np.abs(r_ - u).max()) for r_, u in zip(jax.tree.leaves(ref), jax.tree.leaves(alt)))
        assert diff > 1e-3 * scale, diff


def test_packed_update_seq_mean_equals_reference(tiny):
    """The packed update path (several trajectories per row, micro-batches looped on the host) with the
    seq_mean arrays gives the same step as the reference gradient of rapo_token_loss."""
    from rexrag_jax.train import packing
    from rexrag_jax.train.update import make_packed_update_fns, packed_update
    cfg, params, b = tiny
    host = jax.tree.map(np.asarray, params)
    opt = optax.identity()
    rc = RapoConfig()
    old, ent = make_logprob_fn(cfg, with_entropy=True)(params, jnp.asarray(b.tokens), jnp.asarray(b.attention_mask))
    from rexrag_jax.train import prepare
    rewards, _ = prepare.score(b)
    arrays, _ = rapo_update_arrays(b, rewards, np.asarray(old), np.asarray(ent), rc)
    micro, apply = make_packed_update_fns(cfg, opt, rc.loss_config())
    lengths = b.attention_mask.sum(axis=1)
    (mbs,) = packing.packed_mini_batches(arrays, lengths, b.size, 1, 48, None)
    assert len(mbs) > 1  # several micro-batches of packed rows
    new, _, m = packed_update(micro, apply, jax.tree.map(jnp.array, params), opt.init(params), mbs,
                              jnp.float32(1.0), jnp.bool_(False))
    assert int(m["loss_tokens"]) == int((arrays["loss_mask"].sum(axis=1) > 0).sum())  # counts sequences
    ref = _reference_delta(cfg, params, b, rewards, rapo_math.RATIO_SHAPING_COEF, "seq_mean")
    scale = max(float(np.abs(x).max()) for x in jax.tree.leaves(ref))
    for d, r_ in zip(jax.tree.leaves(jax.tree.map(lambda a, p: np.asarray(a) - p, new, host)), jax.tree.leaves(ref)):
        np.testing.assert_allclose(d, r_, atol=1e-5 * scale, rtol=1e-3)
