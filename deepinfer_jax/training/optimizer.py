"""AdamW with linear warmup + cosine decay and global-norm gradient clipping."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-3
    warmup_steps: int = 10
    total_steps: int = 1000
    min_lr_ratio: float = 0.1      # final lr = lr * min_lr_ratio
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    indexer_loss_weight: float = 1.0   # the indexers' KL (training/indexer_loss.py) in the loss
    balance_rate: float = 1e-3         # gate-bias step per update (training/routing_balance.py)

    def validate(self) -> "OptimConfig":
        for f in ("lr", "total_steps", "clip_norm"):
            if getattr(self, f) <= 0:
                raise ValueError(f"OptimConfig.{f}={getattr(self, f)!r}: must be > 0")
        if not 0 <= self.warmup_steps <= self.total_steps:
            raise ValueError(f"OptimConfig.warmup_steps={self.warmup_steps}: must be in [0, total_steps={self.total_steps}]")
        for f in ("indexer_loss_weight", "balance_rate"):
            if getattr(self, f) < 0:
                raise ValueError(f"OptimConfig.{f}={getattr(self, f)!r}: must be >= 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"OptimConfig.min_lr_ratio={self.min_lr_ratio}: must be in [0, 1]")
        return self


def schedule(oc: OptimConfig) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=oc.lr, warmup_steps=oc.warmup_steps,
        decay_steps=max(oc.total_steps, oc.warmup_steps + 1), end_value=oc.lr * oc.min_lr_ratio)


def lr_at(oc: OptimConfig, step, total_steps):
    """``schedule(oc)`` with the run's length as an argument (a traced scalar inside the step, so
    a run whose length is decided after it starts, ``train.py --steps auto``, compiles once)."""
    step = jnp.asarray(step, jnp.float32)
    total = jnp.maximum(jnp.asarray(total_steps, jnp.float32), oc.warmup_steps + 1)
    warm = oc.lr * step / max(oc.warmup_steps, 1)
    frac = jnp.clip((step - oc.warmup_steps) / (total - oc.warmup_steps), 0.0, 1.0)
    end = oc.lr * oc.min_lr_ratio
    cos = end + (oc.lr - end) * 0.5 * (1.0 + jnp.cos(jnp.pi * frac))
    return jnp.where(step < oc.warmup_steps, warm, cos)


def make_optimizer(oc: OptimConfig, decay_mask=None) -> optax.GradientTransformation:
    """Clipped AdamW at learning rate 1: the step scales its updates by ``lr_at`` (decoupled weight
    decay included, as ``optax.adamw`` with a schedule does)."""
    oc.validate()
    return optax.chain(
        optax.clip_by_global_norm(oc.clip_norm),
        optax.adamw(1.0, b1=oc.b1, b2=oc.b2, eps=oc.eps, weight_decay=oc.weight_decay, mask=decay_mask),
    )
