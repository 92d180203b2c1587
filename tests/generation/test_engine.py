"""GenerationEngine against full-recompute references (model.forward without cache)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rexrag_jax.generation import GenerationEngine
from rexrag_jax.generation import kernels
from rexrag_jax.models.qwen2.config import Qwen2Config
from rexrag_jax.models.qwen2.model import forward, init_params

CFG = Qwen2Config.from_preset("tiny")
B, S, REF_T = 4, 128, 128


@pytest.fixture(scope="module")
def params():
    # std 0.2 gives peaked, input-dependent next-token distributions (0.02 would be near uniform).
    return init_params(CFG, jax.random.PRNGKey(0), std=0.2)


@functools.partial(jax.jit, static_argnums=())
def _ref_logits(params, tokens, mask):
    return forward(params, tokens, CFG, attention_mask=mask)[0]


def full_logits(params, seq):
    """Logits [len(seq), V] of a cache-free forward over seq (right-padded to a fixed shape)."""
    tokens = np.zeros((1, REF_T), np.int32)
    tokens[0, : len(seq)] = seq
    mask = np.arange(REF_T)[None] < len(seq)
    return np.asarray(_ref_logits(params, jnp.asarray(tokens), jnp.asarray(mask)))[0, : len(seq)]


def greedy_reference(params, prompt, n):
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(np.argmax(full_logits(params, seq)[-1])))
    return seq[len(prompt):]


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def make_engine(params, **kw):
    kw.setdefault("decode_chunk", 8)
    kw.setdefault("stop_strings", ())
    return GenerationEngine(params, CFG, B, S, pad_id=0, **kw)


PROMPTS = [[5, 17, 300, 42, 9, 77, 1], [400, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]


def test_greedy_matches_full_recompute_argmax(params):
    eng = make_engine(params)
    eng.append([0, 1, 3], PROMPTS)
    outs = eng.generate([0, 1, 3], 20, jax.random.PRNGKey(0), greedy=True)
    for prompt, out in zip(PROMPTS, outs):
        assert out.tokens == greedy_reference(params, prompt, 20)
        assert out.stop_reason == "length"
    np.testing.assert_array_equal(eng.lengths(), [7 + 20, 2 + 20, 0, 11 + 20])
    assert eng.row_tokens(1) == PROMPTS[1] + outs[1].tokens


def test_temperature_zero_is_greedy(params):
    eng = make_engine(params)
    eng.append([0, 1], PROMPTS[:2])
    g = eng.generate([0, 1], 12, jax.random.PRNGKey(0), greedy=True)
    eng.reset()
    eng.append([0, 1], PROMPTS[:2])
    t0 = eng.generate([0, 1], 12, jax.random.PRNGKey(7), temperature=0.0, top_p=0.3)
    assert [o.tokens for o in g] == [o.tokens for o in t0]
    assert all(x == 0.0 for o in t0 for x in o.sampling_logprobs)


def test_logprobs_equal_full_forward_log_softmax(params):
    eng = make_engine(params)
    eng.append([0, 2], [PROMPTS[0], PROMPTS[2]])
    temp = 0.7
    outs = eng.generate([0, 2], 24, jax.random.PRNGKey(3), temperature=temp)
    for prompt, out in zip([PROMPTS[0], PROMPTS[2]], outs):
        seq = prompt + out.tokens
        lg = full_logits(params, seq)[len(prompt) - 1: -1]
        tok = np.array(out.tokens)
        raw = log_softmax(lg)[np.arange(len(tok)), tok]
        scaled = log_softmax(lg / temp)[np.arange(len(tok)), tok]
        # float32 noise of two different reduction orders (cached vs full forward) on log-probs of
        # magnitude ~7: relative 1e-5 on top of absolute 1e-5 (it failed at 1.6e-5 absolute, 2.4e-6 relative)
        np.testing.assert_allclose(out.logprobs, raw, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(out.sampling_logprobs, scaled, atol=1e-5, rtol=1e-5)
        assert len(set(out.tokens)) > 3  # actually sampled, not a constant stream


def test_append_to_subset_leaves_other_rows_unchanged(params):
    eng = make_engine(params)
    eng.append([0, 1, 2], PROMPTS)
    n1 = int(eng.lengths()[1])
    k1, v1 = np.asarray(eng._k[:, 1, :n1]), np.asarray(eng._v[:, 1, :n1])
    logits1 = np.asarray(eng._last_logits[1])
    # 40 tokens into row 0 (two prefill chunks with the 32 cap below) and a short one into row 2
    eng.prefill_chunk = 32
    eng.append([0, 2], [list(range(100, 140)), [7, 7, 7]])
    np.testing.assert_array_equal(np.asarray(eng._k[:, 1, :n1]), k1)
    np.testing.assert_array_equal(np.asarray(eng._v[:, 1, :n1]), v1)
    np.testing.assert_array_equal(np.asarray(eng._last_logits[1]), logits1)
    np.testing.assert_array_equal(eng.lengths()[:3], [7 + 40, 2, 11 + 3])
    outs = eng.generate([0, 1, 2], 10, jax.random.PRNGKey(0), greedy=True)
    assert outs[1].tokens == greedy_reference(params, PROMPTS[1], 10)
    assert outs[0].tokens == greedy_reference(params, PROMPTS[0] + list(range(100, 140)), 10)
    assert outs[2].tokens == greedy_reference(params, PROMPTS[2] + [7, 7, 7], 10)


def test_multi_chunk_prefill_last_logits(params):
    eng = make_engine(params, prefill_chunk=16)
    prompt = [int(x) for x in np.random.RandomState(0).randint(1, CFG.vocab_size, 50)]
    eng.append([3], [prompt])
    np.testing.assert_allclose(np.asarray(eng._last_logits[3]), full_logits(params, prompt)[-1], atol=1e-4)


@pytest.mark.parametrize("cut", ["full", "partial"])
def test_copy_prefix_splice_matches_fresh_prefill(params, cut):
    eng = make_engine(params)
    eng.append([0], [PROMPTS[0]])
    first = eng.generate([0], 9, jax.random.PRNGKey(1), temperature=1.0)[0]
    history = PROMPTS[0] + first.tokens
    length = len(history) if cut == "full" else len(history) - 4
    eng.append([2], [[99, 98, 97, 96, 95, 94, 93, 92, 91, 90]])  # dst row has stale content to be replaced
    eng.copy_prefix(0, 2, length)
    assert eng.row_tokens(2) == history[:length]
    probe = [250, 251, 252]
    eng.append([2], [probe])  # the probe prompt goes after the copied prefix
    eng.append([1], [history[:length] + probe])  # fresh re-prefill of the whole thing
    a, b = eng.generate([2, 1], 12, jax.random.PRNGKey(0), greedy=True)
    assert a.tokens == b.tokens == greedy_reference(params, history[:length] + probe, 12)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    # the source row is untouched by the splice
    assert eng.row_tokens(0) == history


def test_truncate_then_generate_recomputes_logits(params):
    eng = make_engine(params)
    eng.append([1], [PROMPTS[2]])
    eng.truncate(1, 6)
    out = eng.generate([1], 8, jax.random.PRNGKey(0), greedy=True)[0]
    assert out.tokens == greedy_reference(params, PROMPTS[2][:6], 8)


def test_top_p_one_sampling_statistics(params):
    """Empirical next-token frequencies match softmax(z / T) (binomial 5-sigma bounds)."""
    eng = make_engine(params)
    temp, n_draws = 0.5, 0
    counts = np.zeros(CFG.vocab_size)
    for i in range(40):
        eng.reset()
        eng.append(list(range(B)), [PROMPTS[1]] * B)
        for o in eng.generate(list(range(B)), 1, jax.random.PRNGKey(100 + i), temperature=temp):
            counts[o.tokens[0]] += 1
            n_draws += 1
    p = np.exp(log_softmax(full_logits(params, PROMPTS[1])[-1] / temp))
    assert p.max() > 0.05  # the test is informative only for a peaked distribution
    sigma = np.sqrt(n_draws * p * (1 - p)) + 1
    assert np.all(np.abs(counts - n_draws * p) <= 5 * sigma)
    top = np.argsort(-p)[:3]
    assert counts[top].sum() > 0


def test_top_p_keeps_samples_inside_nucleus(params):
    eng = make_engine(params)
    top_p = 0.6
    z = full_logits(params, PROMPTS[1])[-1]
    p = np.exp(log_softmax(z))
    order = np.argsort(-p)
    before = np.cumsum(p[order]) - p[order]
    nucleus = set(order[before < top_p].tolist())
    seen = set()
    for i in range(10):
        eng.reset()
        eng.append(list(range(B)), [PROMPTS[1]] * B)
        for o in eng.generate(list(range(B)), 1, jax.random.PRNGKey(i), top_p=top_p):
            seen.add(o.tokens[0])
            q = np.where(np.isin(np.arange(len(p)), list(nucleus)), p, 0)
            np.testing.assert_allclose(o.sampling_logprobs[0], np.log(q[o.tokens[0]] / q.sum()), atol=1e-5)
    assert seen <= nucleus and len(nucleus) < CFG.vocab_size


def test_eos_stops_row(params):
    target = greedy_reference(params, PROMPTS[0], 6)
    eos = target[4]
    first = target.index(eos)
    eng = make_engine(params, eos_ids=(eos,))
    eng.append([0, 1], PROMPTS[:2])
    a, b = eng.generate([0, 1], 10, jax.random.PRNGKey(0), greedy=True)
    assert a.tokens == target[: first + 1] and a.stop_reason == "eos"
    assert len(a.logprobs) == len(a.tokens)
    assert eng.lengths()[0] == len(PROMPTS[0]) + first + 1
    ref_b = greedy_reference(params, PROMPTS[1], 10)
    assert b.tokens == ref_b[: ref_b.index(eos) + 1] if eos in ref_b else b.tokens == ref_b


def test_params_setter_uses_new_weights_without_recompile(params):
    eng = make_engine(params)
    eng.append([0], [PROMPTS[0]])
    eng.generate([0], 8, jax.random.PRNGKey(0), greedy=True)
    compiled = kernels.decode_chunk._cache_size()
    new = init_params(CFG, jax.random.PRNGKey(5), std=0.2)
    eng.params = new
    eng.reset()
    eng.append([0], [PROMPTS[0]])
    out = eng.generate([0], 8, jax.random.PRNGKey(0), greedy=True)[0]
    assert out.tokens == greedy_reference(new, PROMPTS[0], 8)
    assert kernels.decode_chunk._cache_size() == compiled


def test_capacity_and_input_errors(params):
    eng = make_engine(params)
    with pytest.raises(ValueError, match="max_len"):
        eng.append([0], [[1] * (S + 1)])
    assert eng.lengths()[0] == 0  # nothing written
    eng.append([0], [[1] * (S - 4)])
    with pytest.raises(ValueError, match="exceeds max_len"):
        eng.generate([0], 5, jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="empty"):
        eng.generate([1], 5, jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="outside"):
        eng.append([1], [[CFG.vocab_size]])
    with pytest.raises(ValueError, match="distinct"):
        eng.append([1, 1], [[1], [2]])
    with pytest.raises(ValueError, match="out of range"):
        eng.truncate(B, 0)


def test_model_cached_forward_matches_full_recompute(params):
    """model.forward(cache=...) (the path every engine kernel runs): prefill rows of different lengths,
    then append ragged chunks (num_new < T pads); logits of every real token equal a cache-free forward
    over the whole sequence, and padded writes beyond a row's length do not disturb later appends."""
    from rexrag_jax.models.qwen2.model import init_cache
    step = jax.jit(lambda p, t, c, n: forward(p, t, CFG, cache=c, num_new=n))
    cache = init_cache(CFG, 2, 32)
    seqs = [[5, 6, 7], [40]]
    _, cache = step(params, jnp.array([[5, 6, 7], [40, 0, 0]], jnp.int32), cache, jnp.array([3, 1], jnp.int32))
    chunk = np.array([[8, 9, 10, 11], [41, 42, 0, 0]], np.int32)
    logits, cache = step(params, jnp.asarray(chunk), cache, jnp.array([4, 2], jnp.int32))
    seqs = [seqs[0] + [8, 9, 10, 11], seqs[1] + [41, 42]]
    np.testing.assert_array_equal(np.asarray(cache["lengths"]), [7, 3])
    for b, n in ((0, 4), (1, 2)):
        want = full_logits(params, seqs[b])[-n:]
        np.testing.assert_allclose(np.asarray(logits[b, :n]), want, atol=1e-4)
    logits, cache = step(params, jnp.array([[12], [43]], jnp.int32), cache, jnp.array([1, 1], jnp.int32))
    for b, tok in ((0, 12), (1, 43)):
        np.testing.assert_allclose(np.asarray(logits[b, 0]), full_logits(params, seqs[b] + [tok])[-1], atol=1e-4)


def test_model_cached_forward_window_bounds_attention(params):
    """window=W reads slots < W only: logits equal the full recompute while the rows fit, and NaNs planted
    at slots >= W are never read (the full-S call multiplies them by zero probabilities: NaN logits)."""
    from rexrag_jax.models.qwen2.model import init_cache
    cache = init_cache(CFG, 2, 64)
    cache["v"] = cache["v"].at[:, :, 16:].set(jnp.nan)
    tokens = jnp.array([[3, 4, 5, 6, 7, 8], [9, 10, 11, 0, 0, 0]], jnp.int32)
    num_new = jnp.array([6, 3], jnp.int32)
    got, c_got = forward(params, tokens, CFG, cache=dict(cache), num_new=num_new, window=16)
    for b, n in ((0, 6), (1, 3)):
        np.testing.assert_allclose(np.asarray(got[b, :n]), full_logits(params, tokens[b, :n].tolist()), atol=1e-4)
    full, _ = forward(params, tokens, CFG, cache=dict(cache), num_new=num_new)  # reads the NaN slots
    assert np.isnan(np.asarray(full)).all()
    assert np.isnan(np.asarray(c_got["v"][:, :, 16:])).all()  # nothing written past the rows
    step, _ = forward(params, jnp.array([[12], [13]], jnp.int32), CFG, cache=c_got, window=16)  # decode path
    for b, seq in ((0, [3, 4, 5, 6, 7, 8, 12]), (1, [9, 10, 11, 13])):
        np.testing.assert_allclose(np.asarray(step[b, 0]), full_logits(params, seq)[-1], atol=1e-4)


def test_vocab_limit_never_samples_padding_rows_and_renormalises(params):
    """Ids >= vocab_limit (embedding rows the tokenizer lacks) are never sampled; log-probs are those of
    the softmax restricted to the first vocab_limit ids."""
    limit = 100
    eng = GenerationEngine(params, CFG, batch_size=B, max_len=S, vocab_limit=limit, decode_chunk=8)
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]
    eng.append(range(B), prompts)
    outs = eng.generate(range(B), 24, jax.random.PRNGKey(3), temperature=1.0)
    toks = [t for o in outs for t in o.tokens]
    assert toks and max(toks) < limit
    # Unrestricted, the same random model does put mass above the limit (the test can fail).
    logits = full_logits(params, prompts[0])[-1]
    assert jax.nn.softmax(logits)[limit:].sum() > 0.1
    seq = prompts[0] + outs[0].tokens
    ref = full_logits(params, seq)
    for t, tok in enumerate(outs[0].tokens):
        masked = np.asarray(jax.nn.log_softmax(ref[len(prompts[0]) - 1 + t][:limit]))
        np.testing.assert_allclose(outs[0].logprobs[t], masked[tok], atol=1e-5)
    with pytest.raises(ValueError, match="vocab_limit"):
        GenerationEngine(params, CFG, batch_size=B, max_len=S, vocab_limit=CFG.vocab_size + 1)


def test_window_buckets_cover_and_stay_within_1_5x():
    from rexrag_jax.generation.engine import _window_at_least
    assert [_window_at_least(n, 64) for n in (1, 64, 65, 97, 129, 193, 257, 385)] == [64, 64, 96, 128, 192, 256,
                                                                                     384, 512]
    for n in range(64, 5000):
        w = _window_at_least(n, 64)
        assert n <= w <= 1.5 * n
    assert len({_window_at_least(n, 64) for n in range(1, 4097)}) == 13  # 64 .. 4096: 2 buckets per octave


def test_rare_prefill_shape_runs_a_compiled_larger_program(params, monkeypatch):
    """A small append after a large one runs the large append's program (padded: idle rows, pad tokens)
    instead of compiling its own bucket, within REUSE_COST x rows x tokens; logits and greedy tokens
    equal an engine that compiles the exact bucket."""
    import dataclasses

    from rexrag_jax.generation import engine as engine_mod
    from rexrag_jax.train import compile_watch

    cfg = dataclasses.replace(CFG, rope_theta=31337.0)  # a config no other test compiled programs for
    rng = np.random.default_rng(5)
    big = [rng.integers(1, CFG.vocab_size, 20).tolist() for _ in range(8)]  # 8 rows x 32-token bucket
    small_rows, small = [1, 4, 6], [rng.integers(1, CFG.vocab_size, 10).tolist() for _ in range(3)]  # 4 x 16

    def run(reuse):
        monkeypatch.setattr(engine_mod, "REUSE_COST", 4 if reuse else 0)
        eng = GenerationEngine(params, cfg, 8, S, pad_id=0)
        eng.append(list(range(8)), big)
        before = compile_watch.compilations()
        eng.append(small_rows, small)
        compiled = compile_watch.compilations() - before
        lengths = eng.lengths()
        logits = np.asarray(eng._last_logits)
        outs = eng.generate(list(range(8)), 6, jax.random.PRNGKey(0), greedy=True)
        return eng, compiled, lengths, logits, [o.tokens for o in outs]

    compile_watch.install()
    eng_r, compiled_r, len_r, logits_r, toks_r = run(reuse=True)
    eng_x, compiled_x, len_x, logits_x, toks_x = run(reuse=False)
    assert compiled_r == 0 and compiled_x > 0  # the exact (4, 16) bucket was a new program
    assert eng_r._compiled_prefill == {(8, 32, 64)} and (4, 16, 64) in eng_x._compiled_prefill
    np.testing.assert_array_equal(len_r, len_x)
    assert len_r.tolist() == [20, 30, 20, 20, 30, 20, 30, 20]
    np.testing.assert_allclose(logits_r, logits_x, atol=1e-5)
    assert toks_r == toks_x
