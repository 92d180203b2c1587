"""One training step through the real rollout path: SearchRollout (GenerationEngine + run_rollouts) on a
tiny random Qwen2 with a tiny SentencePiece tokenizer and an in-memory retriever."""
import numpy as np
import pytest

from rexrag_jax.data.prompts import PROMPT_TEMPLATE
from rexrag_jax.data.schema import QAExample
from rexrag_jax.models.qwen2.config import Qwen2Config
from rexrag_jax.rl.prompt_pool import DEFAULT_REVISION_PROMPTS
from rexrag_jax.rollout.loop import RolloutConfig
from rexrag_jax.tokenizers import train_sentencepiece
from rexrag_jax.train.metrics_log import read_metrics
from rexrag_jax.train.rollout_source import SearchRollout
from rexrag_jax.train.trainer import TrainConfig, Trainer

TINY = Qwen2Config.from_preset("tiny")
EXAMPLES = [QAExample("0", "who wrote the tiny test", ["nobody"], "nq"),
            QAExample("1", "where is the answer", ["here"], "hotpotqa")]


class ListRetriever:
    def __init__(self):
        self.calls = 0

    def search(self, queries, topk=3):
        self.calls += 1
        return [[{"document": {"id": str(k), "contents": f'"Title {k}"\nbody {k}'}, "score": 1.0}
                 for k in range(topk)] for _ in queries]


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    lines = [PROMPT_TEMPLATE, *DEFAULT_REVISION_PROMPTS, *(e.question for e in EXAMPLES),
             "<search> query </search> <answer> x </answer> <information> Doc 1(Title: t) body </information>",
             "My action is invalid."] * 3
    return str(train_sentencepiece(lines, tmp_path_factory.mktemp("spm") / "train", vocab_size=500))


def test_one_step_with_the_real_rollout(tokenizer_path, tmp_path):
    rcfg = RolloutConfig(max_turns=1, max_new_tokens=8, max_obs_tokens=16, max_context=200)
    source = SearchRollout(tokenizer_path=tokenizer_path, retriever=ListRetriever(), config=rcfg, decode_chunk=4)
    cfg = TrainConfig(total_steps=1, num_questions=2, group_size=2, mini_batch=4, micro_batch=2, max_seq_len=512,
                      length_bucket=64, logprob_chunk=0, checkpoint_every=1, eval_every=0)
    # Model vocab = tokenizer vocab: a random model samples every id it has, and ids past the tokenizer's
    # vocabulary cannot be decoded (the engine does not mask them).
    model_cfg = TINY.replace(vocab_size=source.tokenizer.vocab_size)
    trainer = Trainer(str(tmp_path), model_cfg=model_cfg, rollout=source, config=cfg, train_examples=EXAMPLES,
                      use_tensorboard=False)
    assert trainer.run() == 0
    m = read_metrics(str(tmp_path))[1]
    assert m["batch/trajectories"] == 4 and m["skipped_updates"] == 0
    assert m["response_len/mean"] >= 8  # at least one generated turn per trajectory
    assert m["loss_tokens/mean"] > 0 and np.isfinite(m["loss"]) and np.isfinite(m["entropy"])
    assert "em/train_nq" in m and "em/train_hotpotqa" in m
    assert (tmp_path / "checkpoints" / "1").is_dir()
