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

In the engine (``EngineConfig.eplb_redundant_experts``, the DP runner) the placement is an input
of the step (``ExpertPlacement``); ``use_placement`` around the trace makes each placed MoE layer
route through it (``route``) and record its per-slot load.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.sharding import context_parallel


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


# ---------------------------------------------------------------- placement inside the step
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ExpertPlacement:
    """The physical placement of every placed MoE layer (``layers[i]`` is row ``i``), the step's
    input: changing it (a rebalance) changes arrays, not the compiled step."""

    phy2log_LR: jax.Array    # int32 [L, R]: the logical expert in each physical slot
    log2phy_LEK: jax.Array   # int32 [L, E, K]: the slots of each expert's replicas, -1 padded
    logcnt_LE: jax.Array     # int32 [L, E]: replicas per expert (>= 1)
    layers: tuple = dataclasses.field(metadata=dict(static=True), default=())


def placement_arrays(phy2log_LR, log2phy_LEK, logcnt_LE, layers) -> ExpertPlacement:
    """``ExpertPlacement`` from EPLB's outputs (numpy, ``eplb.rebalance_experts``); ``log2phy`` is
    padded to ``K = R - E + 1`` replicas (the most any expert can have), so every placement of
    the same sizes has the same shapes (letters as ``eplb.py``'s)."""
    phy2log_LR = np.asarray(phy2log_LR, np.int32)
    L, R = phy2log_LR.shape
    E = np.asarray(logcnt_LE).shape[1]
    l2p = np.full((L, E, R - E + 1), -1, np.int32)
    k = np.asarray(log2phy_LEK).shape[2]
    l2p[:, :, :k] = np.asarray(log2phy_LEK, np.int32)
    return ExpertPlacement(phy2log_LR, l2p, np.asarray(logcnt_LE, np.int32), tuple(layers))


def initial_placement(num_layers: int, n_experts: int, num_physical: int, layers) -> ExpertPlacement:
    """Slot ``r`` holds expert ``r mod E``: the first ``R - E`` experts get a second replica."""
    phy2log = np.tile(np.arange(num_physical) % n_experts, (num_layers, 1))
    return placement_from_phy2log(phy2log, n_experts, layers)


def placement_from_phy2log(phy2log_LR, n_experts: int, layers) -> ExpertPlacement:
    phy2log_LR = np.asarray(phy2log_LR)
    L, R = phy2log_LR.shape
    cnt = np.zeros((L, n_experts), np.int64)
    l2p = np.full((L, n_experts, R - n_experts + 1), -1, np.int64)
    for li in range(L):
        for r, e in enumerate(phy2log_LR[li]):
            l2p[li, e, cnt[li, e]] = r
            cnt[li, e] += 1
    return placement_arrays(phy2log_LR, l2p, cnt, layers)


_PLACEMENT: contextvars.ContextVar = contextvars.ContextVar("deepinfer_expert_placement", default=None)


@contextlib.contextmanager
def use_placement(placement: ExpertPlacement, live_T=None, live_decoder_T=None, decoder_from: int | None = None):
    """Route the placed MoE layers traced inside this block through ``placement`` and record
    their per-slot loads (``recorded_loads``). ``live_T`` / ``live_decoder_T``: the tokens that
    count (padding does not); layers from ``decoder_from`` on see the decoder's tokens when
    ``live_decoder_T`` is given (compact truncation)."""
    state = dict(placement=placement, live=live_T, live_dec=live_decoder_T, dec_from=decoder_from, loads={})
    tok = _PLACEMENT.set(state)
    try:
        yield state
    finally:
        _PLACEMENT.reset(tok)


def route(layer: int, idx_TX: jax.Array, n_experts: int):
    """``(physical ids, number of physical slots)`` for backbone MoE layer ``layer`` (of
    ``n_experts`` logical experts) under the active placement, recording its load;
    ``(idx_TX, None)`` when the layer is not placed (no placement, a DSpark stage)."""
    state = _PLACEMENT.get()
    if state is None or layer not in state["placement"].layers or state["placement"].logcnt_LE.shape[1] != n_experts:
        return idx_TX, None
    pl = state["placement"]
    row = pl.layers.index(layer)
    phys = physical_ids(idx_TX, pl.log2phy_LEK[row], pl.logcnt_LE[row])
    R = pl.phy2log_LR.shape[1]
    live = state["live"]
    if state["live_dec"] is not None and state["dec_from"] is not None and layer >= state["dec_from"]:
        live = state["live_dec"]
    if live is not None:
        live = context_parallel.localize_mask(live)   # a CP step: this device's tokens
    counted = phys if live is None or live.shape[0] != phys.shape[0] else jnp.where(live[:, None], phys, -1)
    load = physical_load(counted, R)
    if context_parallel.split_axes():   # a CP step's cp devices route distinct tokens
        load = jax.lax.psum(load, context_parallel.split_axes())
    state["loads"][layer] = load
    return phys, R


def recorded_loads(state) -> jax.Array:
    """int32 ``[L, R]`` loads the placed layers recorded in a ``use_placement`` block."""
    pl = state["placement"]
    R = pl.phy2log_LR.shape[1]
    return jnp.stack([state["loads"].get(l, jnp.zeros((R,), jnp.int32)) for l in pl.layers])
