"""Supervised warm start on trajectories in the exact rollout format (SPEC §1), for the demo policy.

A warm-start record (rexrag_jax.data.warmstart) is a prompt plus `segments` [[kind, text], ...] with
kind "response" (model tokens: in the loss), "information" (observation), "context" (model text, not
learnt) or "probe" (inserted revision prompt, not learnt); only "response" is in the loss. Tokens are
laid out exactly as the rollout loop lays them out:

    encode(render_prompt(q)) + encode(response_1) + encode(obs_1) + encode(response_2) + ...

each piece tokenized on its own, the observation normalised to the rollout's
`format_observation` text (passages `.strip()`-ed), so the SFT policy sees at training time the very
token sequences it will condition on in a rollout. The loss is the token mean of -log p over the
response tokens of a batch:

    L = - Σ_{n,t} m[n,t] log p(x[n,t] | x[n,<t]) / Σ_{n,t} m[n,t]

optimised with AdamW under a warmup + cosine schedule (optax.warmup_cosine_decay_schedule).
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Sequence

import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax

from rexrag_jax.data.prompts import render_prompt
from rexrag_jax.data.warmstart import SEGMENT_KINDS
from rexrag_jax.models.qwen2 import model as qwen2
from rexrag_jax.models.qwen2.config import Qwen2Config

_INFO_OPEN, _INFO_CLOSE = "\n\n<information>", "</information>\n\n"


def normalise_observation(text: str) -> str:
    """`\\n\\n<information>{p}</information>\\n\\n` -> the same with p.strip() (rollout.format_observation)."""
    if not (text.startswith(_INFO_OPEN) and text.endswith(_INFO_CLOSE)):
        raise ValueError(f"observation segment must look like '\\n\\n<information>...</information>\\n\\n', "
                         f"got {text[:60]!r}...")
    return f"{_INFO_OPEN}{text[len(_INFO_OPEN):-len(_INFO_CLOSE)].strip()}{_INFO_CLOSE}"


def encode_record(tokenizer, record: dict, where: str = "record") -> tuple[list[int], list[bool]]:
    """(tokens, loss_mask) of one warm-start record; see the module docstring for the layout."""
    for field in ("question", "segments"):
        if field not in record:
            raise ValueError(f"{where}: missing field {field!r} (expected a warm-start trajectory record)")
    tokens = tokenizer.encode(render_prompt(tokenizer, record["question"]))
    mask = [False] * len(tokens)
    for i, seg in enumerate(record["segments"]):
        if not (isinstance(seg, (list, tuple)) and len(seg) == 2 and seg[0] in SEGMENT_KINDS):
            raise ValueError(f"{where}: segments[{i}] = {str(seg)[:60]!r}; expected [kind, text] with kind one of "
                             f"{', '.join(SEGMENT_KINDS)}")
        kind, text = seg
        piece = tokenizer.encode(normalise_observation(text) if kind == "information" else text)
        tokens += piece
        mask += [kind == "response"] * len(piece)
    return tokens, mask


@dataclasses.dataclass
class SFTData:
    tokens: np.ndarray     # int32 [N, T], right-padded with pad_id
    loss_mask: np.ndarray  # bool [N, T]
    lengths: np.ndarray    # int32 [N]


def build_sft_data(tokenizer, records: Sequence[dict], max_len: int, bucket: int = 64) -> SFTData:
    """Encode and right-pad `records`; T = the longest length rounded up to `bucket` (rows longer than
    max_len raise: the demo keeps every trajectory whole)."""
    enc = [encode_record(tokenizer, r, where=f"warm-start record {i} (id {r.get('id')!r})")
           for i, r in enumerate(records)]
    if not enc:
        raise ValueError("build_sft_data: no records")
    longest = max(len(t) for t, _ in enc)
    if longest > max_len:
        raise ValueError(f"build_sft_data: a trajectory has {longest} tokens > max_len={max_len}")
    T = min(max_len, -(-longest // bucket) * bucket)
    toks = np.full((len(enc), T), tokenizer.pad_id, np.int32)
    mask = np.zeros((len(enc), T), bool)
    for i, (t, m) in enumerate(enc):
        toks[i, :len(t)] = t
        mask[i, :len(m)] = m
    return SFTData(toks, mask, np.array([len(t) for t, _ in enc], np.int32))


def masked_nll(params, tokens, loss_mask, cfg: Qwen2Config):
    """(Σ -log p over masked tokens, number of masked tokens) for one right-padded batch."""
    attn = tokens >= 0  # every position is attended; padding is right of all real tokens (causal)
    logp = qwen2.token_logprobs(params, tokens, cfg, attention_mask=attn)
    m = loss_mask.astype(jnp.float32)
    return -jnp.sum(logp * m), jnp.sum(m)


def make_sft_step(cfg: Qwen2Config, optimizer: optax.GradientTransformation) -> Callable:
    """jit(step)(params, opt_state, tokens, loss_mask) -> (params, opt_state, loss, grad_norm); donates state."""
    def loss_fn(params, tokens, loss_mask):
        s, c = masked_nll(params, tokens, loss_mask, cfg)
        return s / jnp.maximum(c, 1.0)

    def step(params, opt_state, tokens, loss_mask):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, loss_mask)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, optax.tree.norm(grads)

    return jax.jit(step, donate_argnums=(0, 1))


@gin.configurable
@dataclasses.dataclass(frozen=True)
class SFTConfig:
    steps: int = 300
    batch_size: int = 32
    learning_rate: float = 1e-3
    warmup_steps: int = 20
    end_lr_fraction: float = 0.05   # cosine decays to this fraction of the peak
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    length_bucket: int = 64         # batches are cut to the longest row's bucket (fewer padded tokens)
    time_budget_s: float | None = None  # stop early (keeping the schedule) once this much time has passed

    def optimizer(self) -> optax.GradientTransformation:
        sched = optax.warmup_cosine_decay_schedule(0.0, self.learning_rate, max(1, self.warmup_steps),
                                                   max(self.steps, self.warmup_steps + 1),
                                                   end_value=self.learning_rate * self.end_lr_fraction)
        return optax.chain(optax.clip_by_global_norm(self.max_grad_norm),
                           optax.adamw(sched, weight_decay=self.weight_decay))


def train_sft(params, cfg: Qwen2Config, data: SFTData, config: SFTConfig, seed: int = 0,
              log_fn: Callable[[int, dict], None] | None = None, progress: bool = True):
    """Run `config.steps` AdamW steps over shuffled batches (epochs reshuffle). Returns (params, history)
    with history = [{"step", "loss", "grad_norm", "lr"}]. Each batch is cut to its longest row's length
    bucket, so a handful of shapes compile."""
    from tqdm.auto import tqdm

    opt = config.optimizer()
    opt_state = opt.init(params)
    step_fn = make_sft_step(cfg, opt)
    rng = np.random.default_rng(seed)
    batches = length_grouped_batches(data.lengths, min(config.batch_size, data.tokens.shape[0]),
                                     config.length_bucket, rng)
    history = []
    t0 = time.perf_counter()
    bar = tqdm(range(config.steps), desc="warm start (SFT)", disable=not progress)
    for step in bar:
        idx = next(batches)
        T = int(min(data.tokens.shape[1], -(-int(data.lengths[idx].max()) // config.length_bucket)
                    * config.length_bucket))
        params, opt_state, loss, gnorm = step_fn(params, opt_state, jnp.asarray(data.tokens[idx, :T]),
                                                 jnp.asarray(data.loss_mask[idx, :T]))
        if step % 10 == 0 or step == config.steps - 1:
            row = {"step": step, "loss": float(loss), "grad_norm": float(gnorm),
                   "lr": float(opt_schedule_value(config, step))}
            history.append(row)
            bar.set_postfix(loss=f"{row['loss']:.3f}")
            if log_fn is not None:
                log_fn(step, {"sft/loss": row["loss"], "sft/grad_norm": row["grad_norm"], "sft/lr": row["lr"]})
            if not math.isfinite(row["loss"]):
                raise FloatingPointError(f"SFT loss became {row['loss']} at step {step}")
        if config.time_budget_s is not None and time.perf_counter() - t0 > config.time_budget_s:
            history.append({"step": step, "loss": float(loss), "grad_norm": float(gnorm),
                            "lr": float(opt_schedule_value(config, step)), "stopped_by_time_budget": True})
            break
    bar.close()
    return params, history


def length_grouped_batches(lengths: np.ndarray, batch_size: int, bucket: int, rng: np.random.Generator):
    """Endless batches of row indices, each drawn from rows of similar length (fewer padded tokens).

    Rows are sorted by length, cut into consecutive groups of `batch_size`, and each epoch visits the
    groups in random order after reshuffling rows within runs of equal length bucket.
    """
    lengths = np.asarray(lengths)
    n = lengths.shape[0]
    while True:
        keys = -(-lengths // bucket) + rng.random(n) * 0.999  # random order inside a length bucket
        order = np.argsort(keys, kind="stable")
        groups = [order[i:i + batch_size] for i in range(0, n - batch_size + 1, batch_size)] or [order]
        for g in rng.permutation(len(groups)):
            yield np.sort(groups[g])


def opt_schedule_value(config: SFTConfig, step: int) -> float:
    sched = optax.warmup_cosine_decay_schedule(0.0, config.learning_rate, max(1, config.warmup_steps),
                                               max(config.steps, config.warmup_steps + 1),
                                               end_value=config.learning_rate * config.end_lr_fraction)
    return float(sched(step))
