"""Next-token cross-entropy over full sequences: position ``t`` predicts token ``t + 1``;
the mean runs over positions whose target is not the pad id."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def next_token_loss(logits_BLV: jax.Array, tokens_BL: jax.Array, pad_id: int) -> tuple[jax.Array, jax.Array]:
    """``(mean loss, number of counted targets)``; the last position has no target."""
    lg = logits_BLV[:, :-1].astype(jnp.float32)
    tgt = tokens_BL[:, 1:]
    logp = jax.nn.log_softmax(lg, axis=-1)
    nll = -jnp.take_along_axis(logp, tgt[..., None], axis=-1)[..., 0]
    mask = (tgt != pad_id).astype(jnp.float32)
    n = jnp.sum(mask)
    return jnp.sum(nll * mask) / jnp.maximum(n, 1.0), n
