"""Balanced context parallelism, device side: a step's tokens split over the ``cp`` axis.

Inside the DP step (``runner/dp_runner.py``: ``shard_map``, every mesh axis manual) a batch that
carries a ``CPLayout`` (``base/cp_layout.py``, the mirror layout) makes each device of a dp
rank's cp group compute only its own ``N = T / P`` tokens: embedding, every per-token
projection, the queries and their attention, the MoE (the tokens then differ over cp, and
``moe_ep.moe_experts_dp`` treats cp like dp). What one token reads of another is exchanged,
never recomputed by a device that does not own the token:

* ``fresh(x_N, home_T)``: this step's values of every token of the rank in flat order (an
  all-gather over cp, then ``home_T``): the window keys of the step and the compressor's
  pooled members (a group crosses chunk boundaries), read by the local queries;
* ``gather(x)``: the destinations and payloads of the cache writes of the local tokens
  (compressed KV, index keys), all-gathered so that every device applies every write: the cp
  devices of a rank keep identical caches, as without CP. The window rings and compressor
  state are written from the ``fresh`` values, whole.

The model gathers the hidden states back to flat order before the head; before compact YOCO
truncation's decoder layers, which run on every cp device (their kept tokens are few), it brings
only the kept tokens' rows (``rows``).

``use(index_N, valid_N)`` marks the trace region whose tokens are split (``split_axes()`` tells
the MoE exchange), and ``localize_mask`` takes a whole-step per-token mask (the expert-load
counter's live tokens) to this device's token slots.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp

from deepinfer_jax.sharding import manual

AXIS = "cp"

_STATE: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("deepinfer_cp_split", default=None)


@contextlib.contextmanager
def use(index_N: jax.Array, valid_N: jax.Array, axis: str = AXIS):
    """Traces inside this block compute the tokens ``index_N`` (flat token ids; ``valid_N``:
    the slot holds one) of this device."""
    tok = _STATE.set((axis, index_N, valid_N))
    try:
        yield
    finally:
        _STATE.reset(tok)


def split_axes() -> tuple[str, ...]:
    """The manual axes over which the traced tokens differ because of CP (``()`` outside ``use``)."""
    st = _STATE.get()
    return () if st is None else (st[0],)


def localize_mask(mask_T: jax.Array) -> jax.Array:
    """A whole-step per-token mask (the placement's live tokens) for this device's token slots
    (unchanged outside ``use``)."""
    st = _STATE.get()
    if st is None:
        return mask_T
    return mask_T[st[1]] & st[2]


def my_index(axis: str = AXIS) -> jax.Array:
    return jax.lax.axis_index(axis)


def gather(x_N: jax.Array, axis: str = AXIS) -> jax.Array:
    """All devices' ``x_N`` concatenated in device order (``[P * N, ...]``)."""
    return jax.lax.all_gather(x_N, axis, tiled=True)


def fresh(x_N: jax.Array, home_T: jax.Array, axis: str = AXIS) -> jax.Array:
    """``[T, ...]``: every token's row in flat order, from each device's ``[N, ...]`` rows."""
    return jnp.take(gather(x_N, axis), home_T, axis=0)


def rows(x_N: jax.Array, home_T: jax.Array, flat_K: jax.Array, axis: str = AXIS) -> jax.Array:
    """``[K, ...]``: the rows of flat tokens ``flat_K`` only, on every device: each owner puts
    its rows in, the others zeros, and an exact sum (bit-cast, ``manual.exact_sum``) adds them.
    Moves ``K`` rows instead of ``fresh``'s ``T`` (compact YOCO truncation keeps few tokens)."""
    N = x_N.shape[0]
    h = home_T[flat_K]
    mine = (h // N) == my_index(axis)
    is_bool = x_N.dtype == jnp.bool_
    v = jnp.take(x_N.astype(jnp.uint8) if is_bool else x_N, h % N, axis=0)
    v = jnp.where(mine.reshape(mine.shape + (1,) * (v.ndim - 1)), v, jnp.zeros((), v.dtype))
    out = manual.exact_sum(v, (axis,))
    return out.astype(jnp.bool_) if is_bool else out
