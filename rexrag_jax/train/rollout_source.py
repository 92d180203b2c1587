"""Rollout sources the trainer can draw from (gin: `Trainer.rollout = @SearchRollout()`).

Interface (what Trainer calls each step):
    source.setup(model_cfg, params, num_trajectories, mesh)   once, before the first step
    source(params, examples, group_size, seed, use_probes) -> (TrajectoryBatch, stats)
    source.pool_distribution(vocab_size) -> PromptPoolDistribution of the inserted revision prompts
    source.evaluate(params, examples) -> list[str] responses (greedy, no probes)   optional

`seed` is derived from (run seed, step), so a resumed run re-draws exactly the same rollouts.
SyntheticRollout (synthetic.py) implements the same interface without a model.
"""
from __future__ import annotations

import dataclasses

import gin
import jax

from rexrag_jax.rl.prompt_pool import PromptPoolDistribution, revision_prompts


@gin.configurable
class SearchRollout:
    """The real multi-turn search rollout (rexrag_jax.rollout.run_rollouts) on a GenerationEngine.

    Args:
      tokenizer_path: HF tokenizer.json / directory or SentencePiece model (rexrag_jax.tokenizers).
      retriever: a Retriever (`.search(queries, topk)`), e.g. `@HttpRetriever()` or `@build_default_retriever()`.
      config: RolloutConfig for training (temperature 1, probes on); evaluation reuses it greedy, probe-free.
      decode_chunk: engine decode steps per host round-trip.
    """

    def __init__(self, tokenizer_path: str = gin.REQUIRED, retriever=gin.REQUIRED, config=None,
                 decode_chunk: int = 16):
        from rexrag_jax.rollout import RolloutConfig
        from rexrag_jax.tokenizers import load_tokenizer

        self.tokenizer = load_tokenizer(tokenizer_path)
        if self.tokenizer.chat_template is None:  # found here, not at step 1 after model init and compiles
            from rexrag_jax.config.errors import StartupInputError
            raise StartupInputError(
                f"SearchRollout.tokenizer_path: {tokenizer_path} has no chat template (expected tokenizer_config.json "
                f"'chat_template' or chat_template.jinja beside tokenizer.json); rollout prompts are rendered with it")
        self.tokenizer_path = tokenizer_path  # recorded in the run dir's policy.json (Trainer) for `rexrag eval`
        self.retriever = retriever
        self.config = config if config is not None else RolloutConfig()
        self.decode_chunk = decode_chunk
        self.engine = None
        self.prompts = revision_prompts()

    def setup(self, model_cfg, params, num_trajectories: int, mesh=None) -> None:
        from rexrag_jax.generation.engine import GenerationEngine
        from rexrag_jax.rollout import required_batch_size

        if self.tokenizer.vocab_size > model_cfg.vocab_size:
            raise ValueError(f"SearchRollout: tokenizer vocab {self.tokenizer.vocab_size} > model vocab "
                             f"{model_cfg.vocab_size}")
        self.engine = GenerationEngine(
            params, model_cfg, batch_size=required_batch_size(num_trajectories, self.config),
            max_len=self.config.max_context + self.config.max_new_tokens, pad_id=self.tokenizer.pad_id,
            eos_ids=getattr(self.tokenizer, "eos_ids", (self.tokenizer.eos_id,)), detokenize=self.tokenizer.decode,
            decode_chunk=self.decode_chunk, mesh=mesh, vocab_limit=self.tokenizer.vocab_size)

    def pool_distribution(self, vocab_size: int) -> PromptPoolDistribution:
        # Tokenized exactly as run_rollouts inserts them (tokenizer.encode of each prompt on its own).
        return PromptPoolDistribution.from_texts(self.prompts, self.tokenizer.encode, vocab_size=vocab_size)

    def __call__(self, params, examples, group_size: int, seed: int, use_probes: bool = True):
        from rexrag_jax.rollout import run_rollouts

        self.engine.params = params
        cfg = dataclasses.replace(self.config, probes=bool(use_probes and self.config.probes))
        return run_rollouts(self.engine, self.tokenizer, self.retriever, examples, group_size,
                            jax.random.PRNGKey(seed), cfg, self.prompts)

    def evaluate(self, params, examples) -> list[str]:
        """Greedy, probe-free responses (one per example), in batches of the engine size."""
        from rexrag_jax.rollout import run_rollouts

        self.engine.params = params
        cfg = dataclasses.replace(self.config, greedy=True, probes=False, temperature=1.0)
        out = []
        for lo in range(0, len(examples), self.engine.batch_size):
            batch, _ = run_rollouts(self.engine, self.tokenizer, self.retriever, examples[lo:lo + self.engine.batch_size],
                                    1, jax.random.PRNGKey(0), cfg, self.prompts)
            out.extend(batch.response_text[:len(examples[lo:lo + self.engine.batch_size])])
        return out


@gin.configurable
def http_retriever(url: str = gin.REQUIRED, timeout: float = 60.0):
    """A Search-R1 compatible retrieval server (`rexrag serve-retriever`), e.g. http://127.0.0.1:8000/retrieve."""
    from rexrag_jax.retrieval.retriever import HttpRetriever
    return HttpRetriever(url, timeout=timeout)


@gin.configurable
def local_retriever(corpus_path: str = gin.REQUIRED, index_dir: str = gin.REQUIRED):
    """In-process MiniLM + exact/ScaNN retriever over a small corpus (built on first use)."""
    from rexrag_jax.retrieval.default import build_default_retriever
    return build_default_retriever(corpus_path, index_dir)
