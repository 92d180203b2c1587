"""AdamW with a linear-warmup-then-constant learning rate, as in the reference (verl) actor.

    lr(s)   = lr_peak · min(1, s / W),   W = int(warmup_fraction · total_steps)
    update  = -lr(s) · ( adam(clip(g, max_norm)) + weight_decay · θ )

The torch AdamW decoupled decay (θ ← θ - lr·(m̂/(√v̂+ε) + wd·θ)) is exactly optax's
`scale_by_adam → add_decayed_weights → scale(-lr)`. The learning rate is NOT part of the optimizer
state: it is passed to the update step, indexed by the *training* step s (verl steps its scheduler
once per training step, after all PPO mini-batches), so every mini-batch of step s uses lr(s).
"""
from __future__ import annotations

import dataclasses

import gin
import optax


@gin.configurable
@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    learning_rate: float = 1e-6
    weight_decay: float = 0.01
    warmup_fraction: float = 0.285
    total_steps: int = 1005
    max_grad_norm: float = 1.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8

    def __post_init__(self):
        if self.learning_rate < 0 or self.weight_decay < 0 or self.max_grad_norm <= 0:
            raise ValueError(f"OptimizerConfig: learning_rate={self.learning_rate}, weight_decay="
                             f"{self.weight_decay}, max_grad_norm={self.max_grad_norm}; expected lr >= 0, "
                             "wd >= 0, max_grad_norm > 0")
        if not 0.0 <= self.warmup_fraction <= 1.0:
            raise ValueError(f"OptimizerConfig.warmup_fraction={self.warmup_fraction}; expected a value in [0, 1]")

    @property
    def warmup_steps(self) -> int:
        return int(self.warmup_fraction * self.total_steps)

    def lr_at(self, step: int) -> float:
        """lr(s) = lr_peak · min(1, s / W) (W = 0: constant lr_peak)."""
        w = self.warmup_steps
        return float(self.learning_rate) if w == 0 or step >= w else float(self.learning_rate) * step / w

    def make(self) -> optax.GradientTransformation:
        """The lr-free part (clip → adam → decoupled decay); the step multiplies by -lr(s)."""
        return optax.chain(
            optax.clip_by_global_norm(self.max_grad_norm),
            optax.scale_by_adam(b1=self.b1, b2=self.b2, eps=self.eps),
            optax.add_decayed_weights(self.weight_decay),
        )
