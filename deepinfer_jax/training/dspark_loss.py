"""The DSpark objective (after DeepSeek's DeepSpec): per draft position ``i`` of a block, weight
``w_i = exp(-i / gamma)`` times the validity mask;

* CE of the draft logits against the true next token (weighted mean);
* L1 between the draft and target distributions, ``sum_v |p_draft - p_target|`` (weighted mean):
  ``1 - L1 / 2`` is the probability that speculative sampling accepts the draft token;
* confidence: BCE-with-logits of the confidence logit against that acceptance rate
  ``r_i = clip(1 - L1_i / 2, 0, 1)`` (stop-gradient; weighted mean).

``total = ce_alpha * CE + l1_alpha * L1 + conf_alpha * BCE``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True)
class DSparkLossConfig:
    gamma: float = 4.0
    ce_alpha: float = 0.1
    l1_alpha: float = 0.9
    conf_alpha: float = 1.0

    def validate(self) -> "DSparkLossConfig":
        if self.gamma <= 0:
            raise ValueError(f"DSparkLossConfig.gamma={self.gamma!r}: must be > 0")
        for f in ("ce_alpha", "l1_alpha", "conf_alpha"):
            if getattr(self, f) < 0:
                raise ValueError(f"DSparkLossConfig.{f}={getattr(self, f)!r}: must be >= 0")
        return self


def decay_weights(block: int, gamma: float = 4.0) -> jax.Array:
    """``exp(-i / gamma)`` for ``i = 0 .. block - 1``."""
    return jnp.exp(-jnp.arange(block, dtype=jnp.float32) / gamma)


def tau_prob(r_NK: jax.Array) -> jax.Array:
    """Expected tokens per verify step of each block, ``1 + sum_k prod_{i<=k} r_i`` ([N])."""
    return 1.0 + jnp.sum(jnp.cumprod(r_NK, axis=-1), axis=-1)


def dspark_loss(draft_logits, confidence, target_ids, target_logits, mask,
                lc: DSparkLossConfig = DSparkLossConfig()) -> tuple[jax.Array, dict]:
    """Arrays ``[..., K(, V)]`` (any leading block axes). Returns ``(total, metrics)``: ``ce``,
    ``l1``, ``conf_bce`` (scalars), ``accept_rate`` and ``greedy_match`` (``[K]``, masked means
    over the blocks), ``tau_prob`` (mean over blocks, invalid positions count as rejected)."""
    K = draft_logits.shape[-2]
    draft_logits = draft_logits.astype(jnp.float32)
    target_logits = jax.lax.stop_gradient(target_logits.astype(jnp.float32))
    mask = mask.astype(jnp.float32)
    w = decay_weights(K, lc.gamma) * mask
    wsum = jnp.maximum(jnp.sum(w), 1e-9)
    logp = jax.nn.log_softmax(draft_logits, axis=-1)
    ce_i = -jnp.take_along_axis(logp, target_ids[..., None].astype(jnp.int32), axis=-1)[..., 0]
    p = jnp.exp(logp)
    q = jax.nn.softmax(target_logits, axis=-1)
    l1_i = jnp.sum(jnp.abs(p - q), axis=-1)
    r = jax.lax.stop_gradient(jnp.clip(1.0 - 0.5 * l1_i, 0.0, 1.0))
    bce_i = optax.sigmoid_binary_cross_entropy(confidence.astype(jnp.float32), r)
    ce = jnp.sum(w * ce_i) / wsum
    l1 = jnp.sum(w * l1_i) / wsum
    bce = jnp.sum(w * bce_i) / wsum
    total = lc.ce_alpha * ce + lc.l1_alpha * l1 + lc.conf_alpha * bce
    lead = tuple(range(mask.ndim - 1))
    n_k = jnp.maximum(jnp.sum(mask, axis=lead), 1.0)
    match = (jnp.argmax(draft_logits, -1) == jnp.argmax(target_logits, -1)).astype(jnp.float32)
    metrics = {
        "loss": total, "ce": ce, "l1": l1, "conf_bce": bce,
        "accept_rate": jnp.sum(r * mask, axis=lead) / n_k,
        "greedy_match": jnp.sum(match * mask, axis=lead) / n_k,
        "tau_prob": jnp.mean(tau_prob((r * mask).reshape(-1, K))),
    }
    return total, metrics
