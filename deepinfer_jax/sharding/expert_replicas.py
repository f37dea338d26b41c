"""Redundant experts: logical routing onto physical expert slots (EPLB's placement).

``eplb.rebalance_experts`` gives, per MoE layer, ``phy2log [R]`` (the logical expert each of the
``R >= E`` physical slots holds), ``log2phy [E, maxcnt]`` (-1 padded) and ``logcnt [E]``
(replicas per logical expert). The gate still routes to logical experts; these functions put
each (token, slot) entry on one replica and build the physical weight stack:

* ``physical_ids``: entry ``j`` (flat over tokens x slots) of logical expert ``e`` goes to
  replica ``j mod logcnt[e]``, so an expert's entries are spread evenly over its replicas,
  deterministically (a function of the batch position only, not of other requests' routing);
* ``physical_stack``: the ``[R, ...]`` weights, slot ``r`` a copy of logical ``phy2log[r]``.

Every replica holds the same weights, so the experts' outputs do not depend on the placement;
``physical_load`` counts entries per physical slot (what the load window records).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def physical_ids(idx_TX: jax.Array, log2phy_EM: jax.Array, logcnt_E: jax.Array) -> jax.Array:
    """int32 ``[T, X]`` physical slots of the logical routing ``idx_TX``; entries outside
    ``[0, E)`` (padding, other shards) stay ``-1``."""
    E = logcnt_E.shape[0]
    T, X = idx_TX.shape
    valid = (idx_TX >= 0) & (idx_TX < E)
    e = jnp.where(valid, idx_TX, 0)
    j = jnp.arange(T * X, dtype=jnp.int32).reshape(T, X)
    replica = j % jnp.maximum(logcnt_E[e], 1)
    return jnp.where(valid, log2phy_EM[e, replica], -1).astype(jnp.int32)


def physical_stack(w_E, phy2log_R: jax.Array):
    """Weights ``[E, ...]`` (an array or a tuple / None leaves) as the ``[R, ...]`` physical stack."""
    return jax.tree.map(lambda a: a[phy2log_R], w_E)


def physical_load(phys_TX: jax.Array, num_physical: int) -> jax.Array:
    """int32 ``[R]`` entries per physical slot (``-1`` entries not counted)."""
    flat = phys_TX.reshape(-1)
    return jnp.bincount(jnp.where(flat >= 0, flat, num_physical), length=num_physical + 1)[:num_physical].astype(jnp.int32)
