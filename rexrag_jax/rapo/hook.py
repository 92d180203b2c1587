"""Trainer hook: a RAPO batch -> the inputs of the project's jitted update step (train.update).

Per trajectory n (policy tokens P = loss_mask minus inserted, inserted tokens I = SEG_RETRIEVED):
    Z_n      = retrieval_rewards(H_old, P, I)                    entropy drop around insertions (rl.rapo)
    A_n      = (1 + 0.2 · A_ret,n) · A_acc,n                     combined_advantages(R, Z, groups)
    F_n      = |I_n| / (|P_n| + |I_n|)                           retrieval_fraction (f_ret_length)
    r̂_t      = (1 + 0.05 · F_n) · r_t,   r_t = π_θ / π_old       ratio shaping, PPO clip at ε = 0.28 on r̂
    mask     = loss_mask ∧ ¬I,           β (KL) = 0
    L        = 1/G Σ_n 1/|P_n| Σ_t loss_t  (aggregation "seq_mean", the paper's; "token_mean": GRPO's)

seq_mean is carried to the update step as two extra arrays (train.update.AGG_KEYS): token_weight [N]
= 1/|P_n| and count_mask [N, T] (one mark per sequence), so the update's Σ sums / Σ counts over
micro-batches (and packed rows) is exactly the mean of per-sequence means over the mini-batch.

The update step (make_update_fn) has no ratio hook, but shaping is a per-row constant factor, so it is
folded into the behaviour log-prob it already takes:
    behaviour_logp_t = log π_old,t − log(1 + 0.05 · F_n)   ⇒   exp(log π_θ − behaviour_logp) = r̂_t.
(The update clamps the log-ratio to ±20 before exp; the shift moves that bound by ≤ log 1.05, which
never matters in practice.) H_old comes from the old-policy pass (train.update.logprobs_and_entropy);
the engine does not report entropies.
"""
from __future__ import annotations

import dataclasses

import gin
import jax.numpy as jnp
import numpy as np

from rexrag_jax.rapo.trace_buffer import SEG_RETRIEVED
from rexrag_jax.rl import rapo as rapo_math
from rexrag_jax.rl.advantages import group_advantages
from rexrag_jax.rollout.types import SEG_PROMPT, TrajectoryBatch
from rexrag_jax.train import prepare
from rexrag_jax.train.update import LossConfig


F_RET_LENGTHS = ("response", "after_prompt")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class RapoConfig:
    ret_adv_coef: float = rapo_math.RET_ADV_COEF          # 0.2
    ratio_coef: float = rapo_math.RATIO_SHAPING_COEF      # 0.05
    clip_eps: float = rapo_math.RAPO_CLIP_EPS             # 0.28
    kl_coef: float = rapo_math.RAPO_KL_COEF               # β = 0
    success_threshold: float = 1.0                        # reward >= this: steps go into the buffer
    aggregation: str = "seq_mean"                         # paper: per-sequence token mean, then mean over
                                                          # sequences; "token_mean": GRPO's token mean
    seq_len_counts_inserted: bool = False                 # |s_i| in seq_mean: policy tokens (False) or
                                                          # policy + inserted tokens (True); paper silent
    f_ret_length: str = "response"                        # F_ret denominator: "response" = policy +
                                                          # inserted tokens; "after_prompt" = every token
                                                          # after the prompt (observations, notes too)

    def __post_init__(self):
        if self.aggregation not in rapo_math.AGGREGATIONS:
            raise ValueError(f"RapoConfig.aggregation={self.aggregation!r}: expected one of "
                             f"{rapo_math.AGGREGATIONS}")
        if self.f_ret_length not in F_RET_LENGTHS:
            raise ValueError(f"RapoConfig.f_ret_length={self.f_ret_length!r}: expected one of {F_RET_LENGTHS}")

    def loss_config(self, temperature: float = 1.0, logprob_chunk: int | None = None) -> LossConfig:
        return LossConfig(eps_low=self.clip_eps, eps_high=self.clip_eps, kl_coef=self.kl_coef,
                          temperature=temperature, logprob_chunk=logprob_chunk)


def masks(batch: TrajectoryBatch) -> tuple[np.ndarray, np.ndarray]:
    """(policy_mask, inserted_mask) [N, T] bool."""
    inserted = batch.segments == SEG_RETRIEVED
    return batch.loss_mask & ~inserted, inserted


def rapo_update_arrays(batch: TrajectoryBatch, rewards, old_logp, entropy, cfg: RapoConfig | None = None
                       ) -> tuple[dict[str, np.ndarray], dict]:
    """The update step's per-row arrays (train.update.MICRO_KEYS) for a RAPO batch, and stats.

    rewards [N]; old_logp, entropy [N, T] from the old-policy pass over batch.tokens.
    """
    cfg = cfg or RapoConfig()
    n, t = batch.tokens.shape
    rewards = np.asarray(rewards, np.float32)
    old_logp, entropy = np.asarray(old_logp, np.float32), np.asarray(entropy, np.float32)
    if rewards.shape != (n,) or old_logp.shape != (n, t) or entropy.shape != (n, t):
        raise ValueError(f"rapo_update_arrays: rewards {rewards.shape}, old_logp {old_logp.shape}, entropy "
                         f"{entropy.shape}; expected ({n},), ({n}, {t}), ({n}, {t})")
    policy, inserted = masks(batch)
    z = rapo_math.retrieval_rewards(entropy, policy, inserted)
    adv = np.asarray(rapo_math.combined_advantages(rewards, z, batch.group_ids, cfg.ret_adv_coef), np.float32)
    a_ret = np.asarray(group_advantages(z, batch.group_ids), np.float32)
    after_prompt = None
    if cfg.f_ret_length == "after_prompt":
        after_prompt = batch.attention_mask & (batch.segments != SEG_PROMPT)
    f_ret = np.asarray(rapo_math.retrieval_fraction(policy, inserted, after_prompt), np.float32)
    behaviour = old_logp - np.log1p(cfg.ratio_coef * f_ret)[:, None]
    loss_mask = np.asarray(rapo_math.rapo_loss_mask(batch.loss_mask, inserted))
    arrays = {"tokens": batch.tokens, "attention_mask": batch.attention_mask, "loss_mask": loss_mask,
              "behaviour_logp": behaviour.astype(np.float32), "advantages": adv, "is_probe": batch.is_probe}
    if cfg.aggregation == "seq_mean":
        weight, count_mask = rapo_math.seq_mean_weights(loss_mask, (loss_mask | inserted)
                                                        if cfg.seq_len_counts_inserted else None)
        arrays["token_weight"] = np.asarray(weight, np.float32)
        arrays["count_mask"] = np.asarray(count_mask, bool)
    # insertions per trajectory: maximal SEG_RETRIEVED runs
    ins_runs = (inserted & ~np.concatenate([np.zeros((n, 1), bool), inserted[:, :-1]], axis=1)).sum(axis=1)
    hybrid = ins_runs > 0

    def mean_std(x):
        return (float(x.mean()), float(x.std())) if len(x) else (0.0, 0.0)
    stats = {"rapo/retrieval_reward_mean": float(z.mean()) if n else 0.0,
             "rapo/hybrid_rows": int(hybrid.sum()),
             "rapo/inserted_fraction_mean": float(f_ret.mean()) if n else 0.0,
             "rapo/insertions_per_traj": float(ins_runs.mean()) if n else 0.0,
             "rapo/insertions_per_hybrid_traj": float(ins_runs[hybrid].mean()) if hybrid.any() else 0.0}
    # Z_ret, A_ret over all rows and over the rows with an insertion (pure rows have Z_ret = 0)
    stats["rapo/z_ret_mean"], stats["rapo/z_ret_std"] = mean_std(z)
    stats["rapo/z_ret_hybrid_mean"], stats["rapo/z_ret_hybrid_std"] = mean_std(z[hybrid])
    stats["rapo/a_ret_mean"], stats["rapo/a_ret_std"] = mean_std(a_ret)
    stats["rapo/a_ret_abs_mean"] = float(np.abs(a_ret).mean()) if n else 0.0
    stats["rapo/f_ret_mean"], stats["rapo/f_ret_std"] = mean_std(f_ret)
    stats["rapo/f_ret_hybrid_mean"] = float(f_ret[hybrid].mean()) if hybrid.any() else 0.0
    return arrays, stats


def rapo_train_step(params, opt_state, update_fn, logprob_fn, batch: TrajectoryBatch, lr, step_seed: int,
                    mini_batch: int, micro_batch: int, cfg: RapoConfig | None = None,
                    structure_format_score: float = 0.0, put=jnp.asarray):
    """One RAPO optimisation step on a rolled-out batch with the project's update step.

    update_fn = train.update.make_update_fn(model_cfg, optimizer, cfg.loss_config(...));
    logprob_fn = train.update.make_logprob_fn(model_cfg, with_entropy=True) (old log-probs + entropies).
    Returns (params, opt_state, metrics, rewards).
    """
    cfg = cfg or RapoConfig()
    rewards, correct = prepare.score(batch, structure_format_score)
    old_logp, entropy = logprob_fn(params, put(batch.tokens), put(batch.attention_mask))
    arrays, stats = rapo_update_arrays(batch, rewards, np.asarray(old_logp), np.asarray(entropy), cfg)
    rng = np.random.default_rng([int(step_seed), 1])
    outs = []
    for mb in prepare.mini_batches(arrays, mini_batch, micro_batch, rng):
        mb = {k: put(v) for k, v in mb.items()}
        params, opt_state, m = update_fn(params, opt_state, mb, jnp.float32(lr), jnp.bool_(False))
        outs.append(m)
    metrics = dict(stats, loss=float(np.mean([float(m["loss"]) for m in outs])),
                   skipped_updates=int(sum(int(m["skipped"]) for m in outs)), updates=len(outs),
                   reward_mean=float(rewards.mean()), em=float(correct.mean()))
    return params, opt_state, metrics, rewards
