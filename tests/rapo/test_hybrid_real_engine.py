"""Hybrid rollout through the real GenerationEngine (tiny random Qwen2): after steps are spliced in with
engine.append, the log-probs the engine reports for later generated tokens equal a full forward pass
over the finished trajectory, i.e. the KV cache holds exactly the trajectory, inserted text included."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from rexrag_jax.data.schema import QAExample
from rexrag_jax.generation.engine import GenerationEngine
from rexrag_jax.models.qwen2.config import Qwen2Config
from rexrag_jax.models.qwen2.model import init_params
from rexrag_jax.rapo.hybrid_rollout import HybridConfig, run_hybrid_rollouts
from rexrag_jax.rapo.trace_buffer import SEG_RETRIEVED, TraceBuffer
from rexrag_jax.rollout import types as T
from rexrag_jax.rollout.loop import RolloutConfig
from rexrag_jax.train.update import policy_logprobs
from rapo_fakes import FakeRetriever, ToyTokenizer, bow_encode

TOK = ToyTokenizer()
CFG = dataclasses.replace(Qwen2Config.from_preset("tiny"), vocab_size=TOK.vocab_size)
MAX_NEW, MAX_CONTEXT = 6, 1200


def test_engine_logprobs_after_insertions_match_full_forward():
    params = init_params(CFG, jax.random.PRNGKey(1))
    engine = GenerationEngine(params, CFG, batch_size=4, max_len=MAX_CONTEXT + MAX_NEW, pad_id=0, eos_ids=[1],
                              detokenize=TOK.decode)
    buf = TraceBuffer(bow_encode, searcher="exact")
    buf.add(["q0", "q1"], ["<think> s </think><search> alpha </search>\n\n<information>doc a</information>\n\n",
                           "<search> beta </search>\n\n<information>doc b</information>\n\n"])
    examples = [QAExample("0", "q0", ["A"], "nq"), QAExample("1", "q1", ["B"], "nq")]
    batch, stats = run_hybrid_rollouts(engine, TOK, FakeRetriever(), examples, 2, jax.random.PRNGKey(3), buf,
                                       RolloutConfig(probes=False, max_turns=3, max_new_tokens=MAX_NEW,
                                                     max_context=MAX_CONTEXT), HybridConfig(insert_prob=1.0))
    inserted = batch.segments == SEG_RETRIEVED
    generated = batch.segments == T.SEG_RESPONSE
    assert stats["insertions"] == 2 and generated.any()  # one hybrid row per group, inserting at turn 1
    first_ins = np.where(inserted.any(1), inserted.argmax(1), batch.tokens.shape[1])
    after = generated & (np.arange(batch.tokens.shape[1])[None] > first_ins[:, None])
    assert after.sum() >= 3, "need generated tokens after an insertion"
    for r in range(batch.size):
        assert engine.row_tokens(r) == batch.tokens[r, :batch.lengths[r]].tolist()
    full = np.asarray(policy_logprobs(params, jnp.asarray(batch.tokens), jnp.asarray(batch.attention_mask), CFG))
    np.testing.assert_allclose(batch.sample_logprobs[generated], full[generated], atol=2e-4)
    assert (batch.sample_logprobs[inserted] == 0).all() and not batch.loss_mask[inserted].any()
