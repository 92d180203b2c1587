"""Rewards and metrics: normalisation, exact match, answer extraction, format rating (SPEC §2)."""
from rexrag_jax.rewards.em import exact_match, extract_last_answer, normalize_answer
from rexrag_jax.rewards.format import F_MAX, format_components, format_rating
from rexrag_jax.rewards.reward import compute_reward

__all__ = ["normalize_answer", "exact_match", "extract_last_answer", "format_rating", "format_components",
           "F_MAX", "compute_reward"]
