"""Pure RL math for REX-RAG and RAPO: advantages, behaviour density, probe filtering, losses, prompt pool.

Modules (formulas in each docstring): `advantages`, `behaviour`, `filtering`, `loss`, `prompt_pool`, `rapo`.
jnp functions (advantages, behaviour, loss, most of rapo) are jittable; `filtering`, the pool trie and
`rapo.retrieval_rewards` are host-side numpy.
"""
from rexrag_jax.rl.advantages import broadcast_to_tokens, group_advantages
from rexrag_jax.rl.behaviour import batch_alpha_err, behaviour_logprobs, probe_token_masks
from rexrag_jax.rl.filtering import (INITIAL_KEEP_RATIO, inserted_mean_logp, num_probes_to_keep, select_probes,
                                     update_keep_ratio)
from rexrag_jax.rl.loss import (combine_micro_batches, entropy_from_logits, grpo_token_loss, k3_kl, ppo_clip_loss,
                                token_mean)
from rexrag_jax.rl.prompt_pool import DEFAULT_REVISION_PROMPTS, PromptPoolDistribution, revision_prompts

__all__ = [
    "DEFAULT_REVISION_PROMPTS", "INITIAL_KEEP_RATIO", "PromptPoolDistribution", "batch_alpha_err",
    "behaviour_logprobs", "broadcast_to_tokens", "combine_micro_batches", "entropy_from_logits",
    "group_advantages", "grpo_token_loss", "inserted_mean_logp", "k3_kl", "num_probes_to_keep",
    "ppo_clip_loss", "probe_token_masks", "revision_prompts", "select_probes", "token_mean", "update_keep_ratio",
]
