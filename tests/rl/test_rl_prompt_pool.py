"""Revision prompt pool: the 30 prompts, gin override, and the exact trie distribution (hand + brute force)."""
import math
import random

import gin
import numpy as np
import pytest

from rexrag_jax.rl.prompt_pool import (DEFAULT_FLOOR_PROB, DEFAULT_REVISION_PROMPTS, PromptPoolDistribution,
                                       revision_prompts)


def test_default_pool_shape_and_style():
    prompts = revision_prompts()
    assert len(prompts) == 30 and len(set(prompts)) == 30
    for p in prompts:
        assert p.startswith("<think> ") and "</think>" not in p
        body = p[len("<think> "):]
        # One sentence: ends with terminal punctuation, none inside.
        assert body[-1] in ".?!" and not any(c in body[:-1] for c in ".?!"), p


def test_gin_override_and_validation():
    gin.clear_config()
    try:
        gin.parse_config("revision_prompts.prompts = ['<think> Am I sure?', '<think> Check again.']")
        assert revision_prompts() == ["<think> Am I sure?", "<think> Check again."]
    finally:
        gin.clear_config()
    assert revision_prompts() == list(DEFAULT_REVISION_PROMPTS)
    with pytest.raises(ValueError, match=r"prompts\[1\].*start"):
        revision_prompts(["<think> ok.", "no think tag."])
    with pytest.raises(ValueError, match=r"prompts\[0\].*close"):
        revision_prompts(["<think> done. </think>"])
    with pytest.raises(ValueError, match="non-empty"):
        revision_prompts([])


def test_trie_hand_computed():
    dist = PromptPoolDistribution([[1, 2, 3], [1, 2, 4], [1, 5], [6]])
    np.testing.assert_allclose(dist.logprobs([1, 2, 3]), np.log([3 / 4, 2 / 3, 1 / 2]), rtol=1e-6)
    np.testing.assert_allclose(dist.logprobs([1, 5]), np.log([3 / 4, 1 / 3]), rtol=1e-6)
    np.testing.assert_allclose(dist.logprobs([6]), np.log([1 / 4]), rtol=1e-6)
    assert dist.logprobs([1, 2, 3]).dtype == np.float32


def test_duplicates_and_prefix_entries_count_as_a_uniform_draw():
    dist = PromptPoolDistribution([[1, 2], [1, 2], [1, 3]])
    np.testing.assert_allclose(dist.logprobs([1, 2]), np.log([1.0, 2 / 3]), rtol=1e-6)
    # [1] is itself an entry: after "1" the pool ends half the time, so P(2 | 1) = 1/2.
    dist = PromptPoolDistribution([[1], [1, 2]])
    np.testing.assert_allclose(dist.logprobs([1, 2]), np.log([1.0, 0.5]), rtol=1e-6)


def test_unseen_tokens_get_the_floor_and_never_raise():
    dist = PromptPoolDistribution([[1, 2, 3], [1, 2, 4], [1, 5], [6]])
    lp = dist.logprobs([1, 9, 3])  # 9 is not a child of "1": it and everything after get the floor
    np.testing.assert_allclose(lp, [math.log(3 / 4), math.log(DEFAULT_FLOOR_PROB), math.log(DEFAULT_FLOOR_PROB)],
                               rtol=1e-6)
    assert dist.matched_len([1, 9, 3]) == 1
    # Longer than any entry (pool exhausted) and unseen first token.
    lp = dist.logprobs([1, 2, 3, 3])
    assert lp[3] == pytest.approx(math.log(DEFAULT_FLOOR_PROB))
    assert dist.logprobs([7])[0] == pytest.approx(math.log(DEFAULT_FLOOR_PROB))
    assert dist.logprobs([]).shape == (0,)
    assert PromptPoolDistribution([[1]], vocab_size=100).logprobs([2])[0] == pytest.approx(math.log(0.01))
    assert PromptPoolDistribution([[1]], floor_prob=0.5).logprobs([2])[0] == pytest.approx(math.log(0.5))
    with pytest.raises(ValueError, match="floor_prob"):
        PromptPoolDistribution([[1]], floor_prob=0.0)
    with pytest.raises(ValueError, match=r"pool_token_lists\[1\]"):
        PromptPoolDistribution([[1], []])


def test_matches_brute_force_counting():
    rng = random.Random(0)
    pool = [[rng.randrange(4) for _ in range(rng.randrange(1, 6))] for _ in range(40)]
    dist = PromptPoolDistribution(pool)

    def n_prefix(prefix):
        return sum(1 for s in pool if s[:len(prefix)] == prefix)

    for _ in range(200):
        seq = rng.choice(pool)[:]
        if rng.random() < 0.3:  # perturb a position to exercise unseen paths
            seq[rng.randrange(len(seq))] = rng.randrange(6)
        expected, alive = [], True
        for i in range(len(seq)):
            num, den = n_prefix(seq[:i + 1]), n_prefix(seq[:i])
            alive = alive and num > 0
            expected.append(math.log(num / den) if alive else math.log(DEFAULT_FLOOR_PROB))
        np.testing.assert_allclose(dist.logprobs(seq), expected, rtol=1e-5, atol=1e-6)


def test_real_bpe_tokenizer_pool_probabilities():
    """The 30 prompts through a byte-level BPE: each full prompt has probability 1/30; boundary merges don't raise."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(DEFAULT_REVISION_PROMPTS) * 3, trainer)
    encode = lambda s: tok.encode(s).ids  # noqa: E731
    dist = PromptPoolDistribution.from_texts(DEFAULT_REVISION_PROMPTS, encode, vocab_size=tok.get_vocab_size())
    for p in DEFAULT_REVISION_PROMPTS:
        ids = encode(p)
        assert math.isclose(float(np.sum(dist.logprobs(ids).astype(np.float64))), math.log(1 / 30), rel_tol=1e-5)
    # Spliced after "</answer>" without a space the first pieces can merge differently: still finite, no raise.
    joint = encode("ok." + DEFAULT_REVISION_PROMPTS[0])
    lp = dist.logprobs(joint[1:])
    assert np.all(np.isfinite(lp)) and lp.shape == (len(joint) - 1,)


def test_logprob_matrix_places_inserted_tokens():
    dist = PromptPoolDistribution([[7, 8], [7, 9]])
    tokens = np.array([[1, 2, 7, 9, 3, 0], [1, 2, 3, 4, 5, 6], [7, 8, 7, 8, 0, 0]])
    out = dist.logprob_matrix(tokens, is_probe=np.array([True, False, True]), probe_start=np.array([2, -1, 2]),
                              probe_len=np.array([2, 0, 2]))
    expected = np.zeros((3, 6), np.float32)
    expected[0, 2:4] = [0.0, math.log(0.5)]
    expected[2, 2:4] = [0.0, math.log(0.5)]
    np.testing.assert_allclose(out, expected, atol=1e-7)
    with pytest.raises(ValueError, match="row 0"):
        dist.logprob_matrix(tokens[:1], np.array([True]), np.array([-1]), np.array([2]))
