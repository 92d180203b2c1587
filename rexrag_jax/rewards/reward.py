"""Training reward (SPEC §2)."""
from __future__ import annotations

from rexrag_jax.rewards.em import exact_match, extract_last_answer
from rexrag_jax.rewards.format import format_rating


def compute_reward(response_text: str, golds, structure_format_score: float = 0.0) -> float:
    """R = EM(last <answer> of the response, golds) + s * F(response).

    With s = structure_format_score = 0 (the reference run) R is binary EM; otherwise a hit scores
    1 + s*F and a miss s*F, F = format_rating in [0, 1.21]. No `<answer>` block -> EM = 0.
    """
    em = exact_match(extract_last_answer(response_text), golds)
    if structure_format_score == 0.0:
        return em
    return em + structure_format_score * format_rating(response_text)
