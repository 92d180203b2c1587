"""Acceptance: the real GenerationEngine with a tiny random Qwen2 and a tiny SentencePiece tokenizer.

A random model never emits tags, so the originals' first turn is forced (appended through the real
engine) to a wrong answer; everything after the probe splice is real greedy generation. The probe's
continuation must equal what a fresh row gives after prefilling the whole probe prefix (original text
up to `<answer>` + revision prompt) from scratch, i.e. splicing changed nothing but the cost.
"""
import jax
import numpy as np
import pytest

from rexrag_jax.data.prompts import PROMPT_TEMPLATE, render_prompt
from rexrag_jax.data.schema import QAExample
from rexrag_jax.generation.engine import GenerationEngine, GenOut
from rexrag_jax.models.qwen2.config import Qwen2Config
from rexrag_jax.models.qwen2.model import init_params
from rexrag_jax.rl.prompt_pool import DEFAULT_REVISION_PROMPTS
from rexrag_jax.rollout import types as T
from rexrag_jax.rollout.loop import RolloutConfig, run_rollouts
from rexrag_jax.tokenizers import load_tokenizer, train_sentencepiece
from rollout_fakes import FakeRetriever

TINY = Qwen2Config.from_preset("tiny")
FORCED = "<think> the answer is obvious </think>\n<answer> wrong guess </answer>"
MAX_NEW, MAX_CONTEXT = 8, 504
EXAMPLES = [QAExample("0", "who wrote the tiny test", ["nobody"], "nq"),
            QAExample("1", "where is the answer", ["here"], "nq")]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    lines = [PROMPT_TEMPLATE, FORCED, *DEFAULT_REVISION_PROMPTS, *(e.question for e in EXAMPLES),
             "Doc 1(Title: test) body of a passage", "My action is invalid."] * 3
    path = train_sentencepiece(lines, tmp_path_factory.mktemp("spm") / "rollout", vocab_size=500)
    t = load_tokenizer(path)
    assert t.vocab_size <= TINY.vocab_size
    return t


class ForcedFirstTurn:
    """Delegates to a real engine; an original's first turn is forced text appended through it."""

    def __init__(self, engine, tok):
        self.engine, self.tok = engine, tok
        self.batch_size, self.max_len = engine.batch_size, engine.max_len

    def __getattr__(self, name):  # append / copy_prefix / truncate / lengths / reset
        return getattr(self.engine, name)

    def generate(self, rows, max_new_tokens, rng, **kw):
        fresh = [r for r in rows if self.tok.decode(self.engine.row_tokens(r)).endswith("assistant\n")]
        real = [r for r in rows if r not in fresh]
        outs = dict(zip(real, self.engine.generate(real, max_new_tokens, rng, **kw))) if real else {}
        if fresh:
            ids = self.tok.encode(FORCED)
            self.engine.append(fresh, [ids] * len(fresh))
            outs.update({r: GenOut(ids, [0.0] * len(ids), "stop", FORCED) for r in fresh})
        return [outs[r] for r in rows]


@pytest.fixture(scope="module")
def engine(tok):
    cfg = Qwen2Config.from_preset("tiny", vocab_size=tok.vocab_size)  # ids the tokenizer can decode only
    params = init_params(cfg, jax.random.PRNGKey(0), std=0.2)
    return GenerationEngine(params, cfg, batch_size=8, max_len=MAX_CONTEXT + MAX_NEW, pad_id=tok.pad_id,
                            eos_ids=tok.eos_ids, detokenize=tok.decode, decode_chunk=8)


@pytest.mark.parametrize("slot_mode", ["source", "free"])
def test_probe_continuation_equals_fresh_prefill(engine, tok, slot_mode):
    prompt_len = len(tok.encode(render_prompt(tok, EXAMPLES[0].question)))
    assert prompt_len < MAX_CONTEXT - 60, prompt_len
    cfg = RolloutConfig(max_turns=2, max_new_tokens=MAX_NEW, max_context=MAX_CONTEXT, greedy=True,
                        revision_prob=1.0, probe_slot=slot_mode)
    batch, stats = run_rollouts(ForcedFirstTurn(engine, tok), tok, FakeRetriever(), EXAMPLES, 2,
                                jax.random.PRNGKey(1), cfg)
    assert stats["probes_created"] == 4 and batch.is_probe.sum() == 4
    assert batch.group_ids.tolist() == [0, 0, 1, 1, 0, 0, 1, 1]
    assert stats["prefill_tokens_saved_by_splice"] > 4 * prompt_len
    for n in np.flatnonzero(batch.is_probe):
        start, plen = int(batch.probe_start[n]), int(batch.probe_len[n])
        p_len = len(tok.encode(render_prompt(tok, batch.examples[n].question)))
        # the probe's text = the original's turn up to <answer>, then one pool prompt
        assert tok.decode(batch.tokens[n, p_len:start].tolist()) == FORCED[: FORCED.index("<answer>")]
        assert tok.decode(batch.tokens[n, start:start + plen].tolist()) in DEFAULT_REVISION_PROMPTS
        # the continuation: the response run right after the inserted prompt
        seg = batch.segments[n]
        end = start + plen
        while end < len(seg) and seg[end] == T.SEG_RESPONSE:
            end += 1
        cont = batch.tokens[n, start + plen:end].tolist()
        assert len(cont) >= 1
        prefix = batch.tokens[n, :start + plen].tolist()
        engine.reset([7])
        engine.append([7], [prefix])
        fresh = engine.generate([7], MAX_NEW, jax.random.PRNGKey(2), greedy=True)[0]
        ref = fresh.tokens[:-1] if (fresh.tokens[-1:] and fresh.tokens[-1] in tok.eos_ids
                                    and len(cont) == len(fresh.tokens) - 1) else fresh.tokens
        assert cont == ref, (n, cont, fresh.tokens)
        np.testing.assert_allclose(batch.sample_logprobs[n, start + plen:end], fresh.logprobs[:len(cont)],
                                   atol=2e-4)
