"""REX-RAG / GRPO trainer: wires rollout → rewards → π_old / reference log-probs → probe filtering →
advantages → behaviour density → mini-batch updates, with checkpoints, resume and logging.

One training step s (s = number of completed steps before it):
  1. questions  = next(data iterator)                          (num_questions per step)
  2. rollouts   = rollout(params, questions, group_size, seed = hash(run seed, s))
  3. rewards    R_i, EM_i (prepare.score)
  4. π_old      log-probs of every row under the current params (+ entropy, for logging)
  5. filtering  K probes kept by mean π_old log-prob of their inserted prompt (ρ from the EWMA)
  6. π_ref      log-probs under the frozen initial params (only when kl_coef > 0)
  7. A          group advantages over originals + kept probes;  α, err;  behaviour log-probs
  8. updates    ppo_epochs × mini-batches (each: micro-batch accumulation, one AdamW step at lr(s))
  9. ρ          ← 0.9 ρ + 0.1 · (fraction of kept probes with reward ≥ 1)
Everything a step draws at random comes from (seed, s), so a resumed run repeats an uninterrupted one.
A checkpoint after step s holds params, optimizer state, s, the data-iterator state, the seed and ρ.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import signal
import time
from typing import Sequence

import gin
import jax
import jax.numpy as jnp
import numpy as np

from rexrag_jax.data.iterator import ShardedIterator
from rexrag_jax.io import paths
from rexrag_jax.models.qwen2 import model as qwen2
from rexrag_jax.models.qwen2.config import Qwen2Config
from rexrag_jax.rl.advantages import group_advantages
from rexrag_jax.rl.behaviour import behaviour_logprobs
from rexrag_jax.rl.filtering import INITIAL_KEEP_RATIO
from rexrag_jax.rl.loss import combine_micro_batches
from rexrag_jax.models.qwen2.flops import train_flops
from rexrag_jax.rollout.types import SEG_PROMPT
from rexrag_jax.shapes import smallest_cover
from rexrag_jax.train import packing, prepare
from rexrag_jax.train.checkpoint import Checkpointer
from rexrag_jax.train.metrics_log import MetricsLogger
from rexrag_jax.train.optim import OptimizerConfig
from rexrag_jax.train.update import (LossConfig, make_logprob_fn, make_packed_update_fns, make_update_fn,
                                     opt_state_shardings, packed_update)

log = logging.getLogger(__name__)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Run hyperparameters (reference values of SPEC §6 as defaults)."""
    seed: int = 0
    total_steps: int = 1005
    num_questions: int = 512          # questions per step
    group_size: int = 5               # rollouts per question
    rollout_batch: int = 0            # ROLLOUT_BATCH: original trajectories per step (0: derived); must
                                      # equal num_questions * group_size (the planner sizes the engine by it)
    mini_batch: int = 256             # trajectories per optimizer step
    micro_batch: int = 8              # trajectories per forward/backward (gradient accumulation)
    logprob_batch: int = 0            # rows per π_old / π_ref pass (0: micro_batch)
    max_seq_len: int = 4096           # trajectories are padded to a multiple of length_bucket, up to this
    length_bucket: int = 512
    ppo_epochs: int = 1
    eps_low: float = 0.2
    eps_high: float = 0.2
    kl_coef: float = 0.001            # k3 KL to the frozen initial policy; 0 skips the reference pass
    temperature: float = 1.0          # log-probs use logits / temperature (as sampled)
    logprob_chunk: int = 512          # positions per chunk of the log-softmax (0: full logits)
    pack_sequences: bool = True       # log-prob and update passes on packed rows (train/packing.py): several
                                      # trajectories per row, attention within each; False: one per row,
                                      # right-padded to the length bucket of the longest
    pack_length: int = 0              # tokens per packed row (0: 4 * length_bucket, capped at the bucketed
                                      # max_seq_len); raised to the bucket of a longer trajectory
    pack_rows: int = 0                # packed rows per micro-batch / log-prob call (0: max(1, micro_batch // 4),
                                      # rounded up to the data-parallel size)
    use_probes: bool = True           # False: plain GRPO (the ablation)
    policy_correction: bool = True    # False: behaviour = π_old for every token, probes included (the
                                      # paper's "w/o policy correction" ablation)
    initial_keep_ratio: float = INITIAL_KEEP_RATIO
    keep_ratio_decay: float = 0.9
    structure_format_score: float = 0.0
    shuffle_mini_batches: bool = True
    checkpoint_every: int = 50
    keep_checkpoints: int = 3
    eval_every: int = 150
    eval_examples: int = 0            # validation questions per evaluation (0: all)
    mesh_shape: Sequence[int] | None = None  # (data, fsdp, tensor); None: single device, no mesh
    inject_nonfinite_steps: Sequence[int] = ()  # test hook: poison the loss of these steps (0-based)
    debug_sleep_s: float = 0.0        # test hook: pause after each step (widens the window of kill tests)

    def __post_init__(self):
        for name in ("total_steps", "num_questions", "group_size", "mini_batch", "micro_batch", "max_seq_len",
                     "length_bucket", "ppo_epochs", "checkpoint_every", "keep_checkpoints"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
                raise ValueError(f"TrainConfig.{name}={v!r}: expected a positive integer")
        if self.rollout_batch and self.rollout_batch != self.num_questions * self.group_size:
            raise ValueError(f"TrainConfig.rollout_batch (ROLLOUT_BATCH) = {self.rollout_batch} but num_questions * "
                             f"group_size = {self.num_questions} * {self.group_size} = "
                             f"{self.num_questions * self.group_size}; expected them equal")
        if self.mini_batch % self.micro_batch:
            raise ValueError(f"TrainConfig.mini_batch={self.mini_batch} must be a multiple of "
                             f"micro_batch={self.micro_batch}")


@gin.configurable
def qa_examples(files: Sequence[str] = (), synthetic: int = 0, data_source: str | None = None):
    """Training/validation questions: read `files` (Search-R1 schema) or make `synthetic` toy ones."""
    if files:
        from rexrag_jax.data.readers import read_qa_files
        return read_qa_files(list(files), data_source=data_source)
    if synthetic:
        from rexrag_jax.train.synthetic import synthetic_examples
        return synthetic_examples(synthetic)
    return []


# The per-step RL math (advantages, behaviour density, α/err) is jitted with the kept rows padded to a
# multiple of ROW_BUCKET: N varies every step (kept probes), and eagerly each new N recompiled every
# primitive (~2 s per RL step in the CPU demo, measured). Padded rows are neutral: singleton groups
# (A = 0) and loss-masked, non-probe rows; they are sliced off before use.
ROW_BUCKET = 16
_group_advantages = jax.jit(group_advantages)
_behaviour_logprobs = jax.jit(behaviour_logprobs)
# (rows, tokens) shapes the two programs ran at: a step with fewer rows or shorter sequences runs a shape
# already compiled (padding is neutral and these are elementwise ops over <= one batch: the extra work is
# negligible; each new shape was a compile, e.g. the first step without kept probes, long after step 3)
_RL_MATH_SHAPES: set[tuple[int, int]] = set()


def _rl_math_shape(n: int, t: int) -> tuple[int, int]:
    rows = -(-n // ROW_BUCKET) * ROW_BUCKET
    shape = smallest_cover(_RL_MATH_SHAPES, (rows, t))
    _RL_MATH_SHAPES.add(shape)
    return shape


def _pad_cols(x: np.ndarray, n_pad: int, fill=0) -> np.ndarray:
    x = np.asarray(x)
    return np.concatenate([x, np.full(x.shape[:1] + (n_pad,), fill, x.dtype)], axis=1) if n_pad else x


def _pad_rows(x: np.ndarray, n_pad: int, fill=0) -> np.ndarray:
    x = np.asarray(x)
    return np.concatenate([x, np.full((n_pad,) + x.shape[1:], fill, x.dtype)]) if n_pad else x


def _alpha_err_host(is_probe, correct) -> tuple[np.float32, np.float32]:
    """rl.behaviour.batch_alpha_err in numpy float32 (the jitted one at exact N compiled for every new N)."""
    is_probe, correct = np.asarray(is_probe, bool), np.asarray(correct, np.float32)
    orig = (~is_probe).astype(np.float32)
    alpha = np.float32(is_probe.sum()) / np.float32(max(len(is_probe), 1))
    n_orig = orig.sum(dtype=np.float32)
    err = np.float32(1.0) - (correct * orig).sum(dtype=np.float32) / max(n_orig, np.float32(1.0)) if n_orig > 0 \
        else np.float32(1.0)
    return alpha, np.float32(err)


def rl_update_math(rewards, correct, group_ids, old_logp, loss_mask, is_probe, probe_start, probe_len, pool_logp,
                   correction: bool = True):
    """(advantages [N], behaviour log-probs [N, T], α, err) of the kept rows, as float32 numpy.

    The formulas live in rexrag_jax.rl (group_advantages, behaviour_logprobs, batch_alpha_err); this only
    pads N to a multiple of ROW_BUCKET (or to an already-compiled larger shape, rows and tokens: see
    _rl_math_shape) so their jitted versions compile for few shapes. correction=False is the ablation
    without the policy correction: behaviour = π_old on every loss-masked token.
    """
    n = len(rewards)
    t = np.asarray(old_logp).shape[1]
    rows, t_pad = _rl_math_shape(n, t)
    pad = rows - n
    gid = np.asarray(group_ids)
    pad_gid = (gid.max() + 1 if n else 0) + np.arange(pad, dtype=gid.dtype)  # each padded row its own group
    adv = np.asarray(_group_advantages(_pad_rows(np.asarray(rewards, np.float32), pad),
                                       np.concatenate([gid, pad_gid])))[:n]
    alpha, err = _alpha_err_host(is_probe, correct)  # exact N (counts); on the host: no compile per new N
    if not correction:
        behaviour = np.where(np.asarray(loss_mask, bool), np.asarray(old_logp, np.float32), 0.0)
        return adv.astype(np.float32), behaviour.astype(np.float32), float(alpha), float(err)
    cols = lambda x, fill=0: _pad_cols(_pad_rows(x, pad, fill), t_pad - t, fill)  # noqa: E731
    behaviour = np.asarray(_behaviour_logprobs(
        cols(old_logp), cols(loss_mask, False), _pad_rows(is_probe, pad, False),
        _pad_rows(probe_start, pad), _pad_rows(probe_len, pad), cols(pool_logp), alpha, err))[:n, :t]
    return adv.astype(np.float32), behaviour.astype(np.float32), float(alpha), float(err)


POLICY_RECORD = "policy.json"


def write_policy_record(run_dir: str, model_cfg: Qwen2Config, rollout) -> None:
    """<run_dir>/policy.json: what `rexrag eval --checkpoint RUN_DIR` needs besides the orbax params, so any
    run dir a Trainer writes (`rexrag train`, the demo's rl/) evaluates without its gin files and with the
    rollout settings it trained with: {"format": 1, "model_config": Qwen2Config fields, "tokenizer": path or
    None, "rollout": RolloutConfig fields or None}. Written atomically, by process 0 only."""
    import os

    if jax.process_index() != 0:
        return
    tok = getattr(rollout, "tokenizer_path", None)
    if isinstance(tok, str) and not paths.is_remote(tok) and os.path.exists(tok):
        tok = os.path.abspath(tok)
    rcfg = getattr(rollout, "config", None)
    record = {"format": 1, "model_config": dataclasses.asdict(model_cfg),
              "tokenizer": tok if isinstance(tok, str) else None,
              "rollout": dataclasses.asdict(rcfg) if dataclasses.is_dataclass(rcfg) else None}
    paths.write_json_atomic(paths.join(run_dir, POLICY_RECORD), record, indent=2, sort_keys=True)


def step_seed(seed: int, step: int) -> int:
    """A 31-bit seed for step `step` of run `seed` (independent streams per step)."""
    return int(np.random.SeedSequence([int(seed), int(step)]).generate_state(1)[0] & 0x7FFFFFFF)


class _Terminate:
    """SIGTERM → finish the current step, checkpoint, exit 0 (preemption notice on TPU VMs)."""

    def __init__(self):
        self.requested = False

    def install(self):
        try:
            signal.signal(signal.SIGTERM, self._handler)
        except ValueError:  # not the main thread (e.g. some test runners): no handler
            pass

    def _handler(self, signum, frame):
        self.requested = True


@gin.configurable(denylist=["run_dir"])
class Trainer:
    """Owns the training state and runs the loop (see the module docstring for one step).

    Args:
      run_dir: checkpoints/, tensorboard/, metrics.jsonl (and the gin configs written by main.py).
      model_cfg: Qwen2Config (gin: @model_config()).
      rollout: a rollout source (rollout_source.SearchRollout, synthetic.SyntheticRollout).
      config / optimizer: TrainConfig / OptimizerConfig.
      train_examples / val_examples: lists of QAExample (gin: @train/qa_examples(), @val/qa_examples()).
      init_checkpoint: HF safetensors directory of the initial policy (None: random init from the seed).
    """

    def __init__(self, run_dir: str, model_cfg: Qwen2Config = gin.REQUIRED, rollout=gin.REQUIRED,
                 config: TrainConfig | None = None, optimizer: OptimizerConfig | None = None,
                 train_examples=gin.REQUIRED, val_examples=None, init_checkpoint: str | None = None,
                 use_tensorboard: bool = True):
        self.run_dir = paths.as_str(run_dir)  # absolute local path, or the gs:// URL (rexrag_jax.io.paths)
        self.cfg = config or TrainConfig()
        self.opt_cfg = optimizer or OptimizerConfig(total_steps=self.cfg.total_steps)
        self.model_cfg = model_cfg
        self.rollout = rollout
        self.train_examples = list(train_examples)
        self.val_examples = list(val_examples or [])
        if len(self.train_examples) < self.cfg.num_questions:
            raise ValueError(f"Trainer: {len(self.train_examples)} training questions cannot fill one step of "
                             f"TrainConfig.num_questions={self.cfg.num_questions}")
        paths.makedirs(self.run_dir)
        write_policy_record(self.run_dir, model_cfg, rollout)
        self.logger = MetricsLogger(self.run_dir, use_tensorboard)
        self.terminate = _Terminate()

        self.mesh = None
        if self.cfg.mesh_shape:
            from rexrag_jax.sharding import make_mesh
            self.mesh = make_mesh(*self.cfg.mesh_shape)
        self.dp_size = 1 if self.mesh is None else int(self.mesh.shape["data"] * self.mesh.shape["fsdp"])
        self._pack_lens_used: set[int] = set()  # packed-row lengths run so far (_pack_len)
        for name in ("micro_batch", "logprob_batch"):
            if (getattr(self.cfg, name) or self.cfg.micro_batch) % self.dp_size:
                raise ValueError(f"TrainConfig.{name} must be a multiple of the data-parallel size {self.dp_size}")

        self.params = self._initial_params(init_checkpoint)
        self.ref_params = None
        if self.cfg.kl_coef > 0:  # frozen copy of the initial policy
            self.ref_params = jax.tree.map(lambda x: jnp.array(x, copy=True), self.params)
        self.optimizer = self.opt_cfg.make()
        self.opt_state = self._init_opt_state()
        self.data = ShardedIterator(self.train_examples, self.cfg.num_questions, seed=self.cfg.seed)
        self.step = 0
        self.keep_ratio = float(self.cfg.initial_keep_ratio)

        loss_cfg = LossConfig(self.cfg.eps_low, self.cfg.eps_high, self.cfg.kl_coef, self.cfg.temperature,
                              self.cfg.logprob_chunk or None)
        out_sh = None if self.mesh is None else (self._param_shardings, self._opt_shardings)
        self._update = make_update_fn(model_cfg, self.optimizer, loss_cfg, out_sh)
        self._packed_micro, self._packed_apply = make_packed_update_fns(model_cfg, self.optimizer, loss_cfg, out_sh)
        self._token_stats = {"real": 0, "padded": 0, "logprob_padded": 0}
        self._logprob = make_logprob_fn(model_cfg, self.cfg.temperature, self.cfg.logprob_chunk or 512, True)
        self._ref_logprob = make_logprob_fn(model_cfg, self.cfg.temperature, self.cfg.logprob_chunk or 512, False)
        self.pool = rollout.pool_distribution(model_cfg.vocab_size)
        rollout.setup(model_cfg, self.params, self.cfg.num_questions * self.cfg.group_size, self.mesh)
        self.ckpt = Checkpointer(paths.join(self.run_dir, "checkpoints"), keep=self.cfg.keep_checkpoints)

    # --- state -----------------------------------------------------------------------------------
    def _initial_params(self, init_checkpoint):
        shardings = None
        if self.mesh is not None:
            from rexrag_jax.sharding import param_shardings
            shardings = param_shardings(self.model_cfg, self.mesh)
        self._param_shardings = shardings
        if init_checkpoint:
            from rexrag_jax.models.qwen2.hf_io import load_params
            return load_params(init_checkpoint, self.model_cfg, shardings)
        init = jax.jit(lambda k: qwen2.init_params(self.model_cfg, k), out_shardings=shardings)
        return init(jax.random.PRNGKey(self.cfg.seed))

    def _init_opt_state(self):
        if self.mesh is None:
            self._opt_shardings = None
            return self.optimizer.init(self.params)
        shapes = jax.eval_shape(self.optimizer.init, self.params)
        self._opt_shardings = opt_state_shardings(self.optimizer, shapes, self._param_shardings, self.mesh)
        return jax.jit(self.optimizer.init, out_shardings=self._opt_shardings)(self.params)

    def _meta(self) -> dict:
        return {"step": self.step, "data_iterator": self.data.state(), "seed": self.cfg.seed,
                "rng": {"kind": "seed+step", "seed": self.cfg.seed, "next_step": self.step},
                "keep_ratio": self.keep_ratio}

    def save(self) -> None:
        self.ckpt.save(self.step, {"params": self.params, "opt_state": self.opt_state}, self._meta())
        log.info("checkpoint %d written to %s", self.step, self.ckpt.directory)

    def maybe_restore(self) -> bool:
        step = self.ckpt.latest_step()
        if step is None:
            return False
        state, meta = self.ckpt.restore(step, {"params": self.params, "opt_state": self.opt_state})
        if int(meta["seed"]) != self.cfg.seed:
            raise ValueError(f"{self.ckpt.directory}/{step}: checkpoint seed {meta['seed']} != TrainConfig.seed "
                             f"{self.cfg.seed}; resuming would not repeat the run")
        self.params, self.opt_state = state["params"], state["opt_state"]
        self.step, self.keep_ratio = int(meta["step"]), float(meta["keep_ratio"])
        self.data.restore(meta["data_iterator"])
        print(f"resumed from checkpoint {step} in {self.ckpt.directory}", flush=True)
        return True

    # --- one step ----------------------------------------------------------------------------------
    def _rows(self, fn, params, tokens, mask):
        if self.cfg.pack_sequences:
            return self._packed_rows(fn, params, tokens, mask)
        rows = self.cfg.logprob_batch or self.cfg.micro_batch
        self._token_stats["logprob_padded"] += -(-tokens.shape[0] // rows) * rows * tokens.shape[1]
        return prepare.rowwise(lambda t, m: fn(params, self._put(t), self._put(m)), (tokens, mask), rows)

    # --- packed layout (train/packing.py) ------------------------------------------------------------
    def _pack_rows(self) -> int:
        rows = self.cfg.pack_rows or max(1, self.cfg.micro_batch // 4)
        return -(-rows // self.dp_size) * self.dp_size

    def _pack_len(self, lengths) -> int:
        cfg = self.cfg
        cap = prepare.length_bucket(cfg.max_seq_len, cfg.length_bucket, 1 << 30)
        base = cfg.pack_length or min(4 * cfg.length_bucket, cap)
        need = packing.pack_length(lengths, base, cfg.length_bucket)
        # a packed-row length already compiled (a step with a longer trajectory raised it) is reused up to
        # 2x the need: rows of that length hold more trajectories, so the padding cost stays small, and a
        # step whose longest trajectory is shorter again does not compile the log-prob and update programs
        # once more (measured: 4 compiles at step 6 of the quick demo's RL)
        (p,) = smallest_cover({(q,) for q in self._pack_lens_used}, (need,), 2)
        self._pack_lens_used.add(p)
        return p

    @staticmethod
    def _lengths(mask) -> np.ndarray:
        mask = np.asarray(mask, bool)
        lengths = mask.sum(axis=1)
        if not (mask == (np.arange(mask.shape[1])[None, :] < lengths[:, None])).all():
            raise ValueError("packing needs right-padded rows (attention_mask a prefix of each row)")
        return lengths

    def _packed_rows(self, fn, params, tokens, mask):
        """The log-prob pass on packed rows; outputs unpacked to [N, T] (0 at padding)."""
        lengths = self._lengths(mask)
        rows = self._pack_rows()
        packed, plan = packing.pack_arrays({"tokens": tokens}, lengths, self._pack_len(lengths), rows)
        self._token_stats["logprob_padded"] += plan.num_rows * plan.pack_len
        outs = prepare.rowwise(lambda t, sg, ps: fn(params, self._put(t), None, self._put(sg), self._put(ps)),
                               (packed["tokens"], packed["segment_ids"], packed["positions"]), rows)
        return [None if o is None else packing.unpack(plan, o, tokens.shape[1]) for o in outs]

    def _put(self, x, leading: int = 0):
        """Host array → device, sharded on its batch dim (dim `leading`) under a mesh."""
        if self.mesh is None:
            return jnp.asarray(x)
        from jax.sharding import NamedSharding
        from rexrag_jax.sharding import spec_for_shape
        axes = (None,) * leading + ("batch",) + (None,) * (np.ndim(x) - leading - 1)
        return jax.device_put(x, NamedSharding(self.mesh, spec_for_shape(axes, np.shape(x), self.mesh)))

    def _run_updates(self, arrays: dict, s: int) -> list:
        """ppo_epochs passes of mini-batch updates over `arrays` at step s; returns host metrics per update."""
        cfg = self.cfg
        lr = jnp.float32(self.opt_cfg.lr_at(s))
        poison = jnp.bool_(s in tuple(cfg.inject_nonfinite_steps))
        outs = []
        rng = np.random.default_rng([cfg.seed, s, 1]) if cfg.shuffle_mini_batches else None
        stats = self._token_stats
        with self._mesh_ctx():
            for _ in range(cfg.ppo_epochs):
                stats["real"] += int(np.asarray(arrays["attention_mask"]).sum())
                if cfg.pack_sequences:
                    lengths = self._lengths(arrays["attention_mask"])
                    for mbs in packing.packed_mini_batches(arrays, lengths, cfg.mini_batch, self._pack_rows(),
                                                           self._pack_len(lengths), rng):
                        stats["padded"] += sum(int(np.size(mb["tokens"])) for mb in mbs)
                        self.params, self.opt_state, m = packed_update(
                            self._packed_micro, self._packed_apply, self.params, self.opt_state, mbs, lr, poison,
                            self._put)
                        outs.append(m)
                    continue
                for mb in prepare.mini_batches(arrays, cfg.mini_batch, cfg.micro_batch, rng):
                    stats["padded"] += int(np.size(mb["tokens"]))
                    mb = {k: self._put(v, leading=1) for k, v in mb.items()}
                    self.params, self.opt_state, m = self._update(self.params, self.opt_state, mb, lr, poison)
                    outs.append(m)
            return jax.device_get(outs)

    def train_step(self) -> dict:
        """One RL step: rollouts → rewards → π_old pass → update inputs → mini-batch updates.

        Run types change only the hooks: `_rollout_batch`, `_update_inputs` (the arrays the jitted update
        consumes, plus batch metrics) and `_after_update`; the timing, update loop and common metrics
        stay here.
        """
        cfg, s = self.cfg, self.step
        self._token_stats = {"real": 0, "padded": 0, "logprob_padded": 0}
        t0 = time.perf_counter()
        batch, rstats = self._rollout_batch(next(self.data), s)
        t_rollout = time.perf_counter() - t0

        rewards, correct = prepare.score(batch, cfg.structure_format_score)
        batch.rewards = rewards
        batch, truncated = prepare.fit_length(batch, cfg.length_bucket, cfg.max_seq_len)
        with self._mesh_ctx():
            old_logp, entropy = self._rows(self._logprob, self.params, batch.tokens, batch.attention_mask)
        arrays, batch_metrics = self._update_inputs(batch, rewards, correct, old_logp, entropy)
        t_logprob = time.perf_counter() - t0 - t_rollout

        update_metrics = self._run_updates(arrays, s)
        t_update = time.perf_counter() - t0 - t_rollout - t_logprob
        batch_metrics.update(self._after_update(batch, rewards))
        self.step += 1
        t_step = time.perf_counter() - t0
        metrics = _update_summary(update_metrics)
        metrics.update(batch_metrics)
        update_tokens = float(arrays["attention_mask"].sum())
        metrics.update({"lr": float(jnp.float32(self.opt_cfg.lr_at(s))), "truncated_rows": truncated,
                        "time/rollout": t_rollout, "time/logprob": t_logprob, "time/update": t_update,
                        "time/step": t_step, "tokens_per_s": update_tokens / max(t_step, 1e-9),
                        "update_tokens_per_s": update_tokens * cfg.ppo_epochs / max(t_update, 1e-9)})
        # model FLOPs of the update passes on real tokens (3 x forward, models/qwen2/flops.py): MFU's numerator
        update_lengths = np.asarray(arrays["attention_mask"], bool).sum(axis=1)
        update_flops = cfg.ppo_epochs * train_flops(self.model_cfg, update_lengths)
        metrics.update({"perf/update_flops": float(update_flops),
                        "perf/update_flops_per_s": update_flops / max(t_update, 1e-9)})
        # update passes (all epochs): real tokens, token slots processed (real + padding), padding share;
        # logprob_padded: slots of the π_old (+ π_ref) passes
        ts = self._token_stats
        metrics.update({"tokens/real": ts["real"], "tokens/padded": ts["padded"],
                        "tokens/padding_frac": 1.0 - ts["real"] / max(ts["padded"], 1),
                        "tokens/logprob_padded": ts["logprob_padded"]})
        for k, v in rstats.items():
            if isinstance(v, (int, float)):
                metrics[f"rollout/{k}"] = v
        return metrics

    def _rollout_batch(self, questions, s: int):
        """(TrajectoryBatch, rollout stats) for step s; probes only when use_probes."""
        cfg = self.cfg
        batch, rstats = self.rollout(self.params, questions, cfg.group_size, step_seed(cfg.seed, s), cfg.use_probes)
        if not cfg.use_probes and batch.is_probe.any():
            batch = batch.select(~batch.is_probe)
        return batch, rstats

    def _update_inputs(self, batch, rewards, correct, old_logp, entropy) -> tuple[dict, dict]:
        """REX-RAG: filter probes, GRPO advantages, behaviour density μ, reference log-probs (β > 0).
        Returns (host arrays for the update, batch metrics); also advances the probe keep ratio."""
        cfg = self.cfg
        keep, kept_probes = prepare.filter_probes(batch, old_logp, self.keep_ratio, cfg.num_questions,
                                                  cfg.group_size, self.dp_size)
        kb = batch.select(keep)
        old_k, ent_k, rew_k, cor_k = old_logp[keep], entropy[keep], rewards[keep], correct[keep]
        ref_logp = None
        if self.ref_params is not None:
            with self._mesh_ctx():
                ref_logp = self._rows(self._ref_logprob, self.ref_params, kb.tokens, kb.attention_mask)[0]
        pool_logp = self.pool.logprob_matrix(kb.tokens, kb.is_probe, kb.probe_start, kb.probe_len)
        adv, behaviour, alpha, err = rl_update_math(rew_k, cor_k, kb.group_ids, old_k, kb.loss_mask, kb.is_probe,
                                                    kb.probe_start, kb.probe_len, pool_logp,
                                                    correction=cfg.policy_correction)
        arrays = {"tokens": kb.tokens, "attention_mask": kb.attention_mask, "loss_mask": kb.loss_mask,
                  "behaviour_logp": behaviour, "advantages": adv, "is_probe": kb.is_probe}
        if ref_logp is not None:
            arrays["ref_logp"] = ref_logp.astype(np.float32)
        # the next step's ratio; this step's filter already used the current one
        self.keep_ratio = prepare.next_keep_ratio(self.keep_ratio, rewards[kept_probes], cfg.keep_ratio_decay)
        metrics = self._batch_metrics(batch, kb, rewards, correct, rew_k, ent_k, kept_probes, alpha, err)
        metrics.update({"keep_ratio": self.keep_ratio, "probes/created": int(batch.is_probe.sum())})
        metrics.update(prepare.group_diagnostics(batch.group_ids, batch.is_probe, correct, kept_probes))
        if kb.is_probe.any():
            metrics.update(prepare.start_ratio_diagnostics(old_k, behaviour, kb.loss_mask, kb.is_probe,
                                                           kb.probe_start, kb.probe_len, adv))
        return arrays, metrics

    def _after_update(self, batch, rewards) -> dict:
        """Hook after the parameter updates of a step (RAPO fills its trace buffer here); metrics."""
        return {}

    def _batch_metrics(self, batch, kb, rewards, correct, rew_k, ent_k, kept_probes, alpha, err) -> dict:
        orig = ~batch.is_probe
        m = {"reward/mean": float(rew_k.mean()), "reward/original": float(rewards[orig].mean()),
             "em/train": float(correct[orig].mean()), "probes/kept": int(len(kept_probes)),
             "alpha": float(alpha), "err": float(err), "batch/trajectories": kb.size}
        if len(kept_probes):
            m["reward/probe_kept"] = float(rewards[kept_probes].mean())
        if batch.is_probe.any():
            m["reward/probe_all"] = float(rewards[batch.is_probe].mean())
        for src in sorted({ex.data_source for ex in batch.examples}):
            sel = orig & np.array([ex.data_source == src for ex in batch.examples])
            m[f"em/train_{src}"] = float(correct[sel].mean())
        mask = kb.loss_mask
        m["entropy"] = float((ent_k * mask).sum() / max(mask.sum(), 1))
        resp = (kb.attention_mask & (kb.segments != SEG_PROMPT)).sum(axis=1)
        m["response_len/mean"], m["response_len/max"] = float(resp.mean()), float(resp.max())
        m["loss_tokens/mean"] = float(mask.sum(axis=1).mean())
        m["searches/mean"] = float(kb.num_searches.mean())
        return m

    def _mesh_ctx(self):
        import contextlib
        if self.mesh is None:
            return contextlib.nullcontext()
        from rexrag_jax.sharding import use_mesh
        return use_mesh(self.mesh)

    # --- validation ----------------------------------------------------------------------------------
    def validate(self) -> dict:
        if not self.val_examples or not hasattr(self.rollout, "evaluate"):
            return {}
        from rexrag_jax.rewards import exact_match, extract_last_answer
        examples = self.val_examples[:self.cfg.eval_examples or None]
        responses = self.rollout.evaluate(self.params, examples)
        by_src: dict[str, list[float]] = {}
        for ex, text in zip(examples, responses):
            by_src.setdefault(ex.data_source, []).append(exact_match(extract_last_answer(text), ex.golden_answers))
        out = {f"val/em_{k}": float(np.mean(v)) for k, v in sorted(by_src.items())}
        out["val/em_mean"] = float(np.mean([np.mean(v) for v in by_src.values()]))
        return out

    # --- the loop ------------------------------------------------------------------------------------
    def run(self, config_text: str | None = None) -> int:
        """Train to total_steps (resuming from the latest checkpoint). Returns the exit code."""
        self.terminate.install()
        self.maybe_restore()
        if config_text is not None:
            self.logger.text("gin/operative_config", config_text, self.step)
        last_saved = self.step
        try:
            while self.step < self.cfg.total_steps:
                if self.terminate.requested:  # arrived between steps
                    if last_saved != self.step:
                        self.save()
                    print(f"SIGTERM: checkpoint {self.step} written, exiting", flush=True)
                    return 0
                metrics = self.train_step()
                if self.cfg.eval_every and self.step % self.cfg.eval_every == 0:
                    metrics.update(self.validate())
                self.logger.log(self.step, metrics)
                if metrics.get("skipped_updates"):
                    log.warning("step %d: %d update(s) skipped (non-finite loss or gradients)",
                                self.step, metrics["skipped_updates"])
                if self.step % self.cfg.checkpoint_every == 0 or self.terminate.requested:
                    self.save()
                    last_saved = self.step
                if self.terminate.requested:
                    print(f"SIGTERM: checkpoint {self.step} written, exiting", flush=True)
                    return 0
                if self.cfg.debug_sleep_s:
                    time.sleep(self.cfg.debug_sleep_s)
            if last_saved != self.step:
                self.save()
            return 0
        finally:
            self.ckpt.close()
            self.logger.close()


def _update_summary(outs: list[dict]) -> dict:
    """Merge the per-mini-batch update metrics: token-weighted means, min/max, summed skips."""
    split_keys = [k for k in outs[0] if "/" in k]
    triples = [(0.0, 0, {k: o[k] for k in split_keys}) for o in outs]
    _, merged = combine_micro_batches(triples)
    out = {k: float(v) for k, v in merged.items()}
    ok = [o for o in outs if not o["skipped"]]
    out["loss"] = float(np.mean([o["loss"] for o in outs]))
    out["grad_norm"] = float(np.mean([o["grad_norm"] for o in ok])) if ok else math.nan
    out["skipped_updates"] = int(sum(int(o["skipped"]) for o in outs))
    out["updates"] = len(outs)
    if "all/kl_mean" in out:
        out["kl"] = out["all/kl_mean"]
    return out
