"""Collectives for code traced inside ``shard_map`` over the mesh (the attention-DP step).

In the data-parallel step (``runner/dp_runner.py``) the whole model runs per device: every mesh
axis is *manual*, each dp rank holds its own requests' tokens (the same on the cp devices of its
group) and parameters arrive as their local shards. Ops whose parameters are split over devices
(routed experts, Engram table rows) then exchange data explicitly; the helpers here do that
exchange without changing a bit of the result:

* ``manual_axes()``: the mesh axes that are manual in the current trace (``()`` outside).
* ``exact_sum(x, axes)`` / ``exact_sum_scatter(x, axes)``: a sum over devices where each element
  is non-zero on at most one device. The values travel bit-cast to unsigned integers, and an
  integer sum of one pattern and zeros is that pattern: no float addition, so no rounding and
  no ``-0.0 + 0.0`` sign change.
* ``gather_rows(table_local, ids, axes)``: ``table[ids]`` of a table whose rows are split over
  ``axes``: ids are all-gathered, each device takes the rows it holds (zeros elsewhere) and an
  exact sum-scatter returns every device its own lookups.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def manual_axes() -> tuple[str, ...]:
    """Names of the mesh axes that are manual (``shard_map``) in the current trace."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return ()
    manual = jax.sharding.AxisType.Manual
    return tuple(n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == manual)


def axes_size(axes: tuple[str, ...]) -> int:
    """Devices in the group of ``axes`` (inside ``shard_map``)."""
    mesh = jax.sharding.get_abstract_mesh()
    return math.prod(mesh.shape[a] for a in axes)


def axis_name(axes: tuple[str, ...]):
    """The ``axis_name`` argument of a collective over ``axes``: the one name, or the tuple."""
    return axes if len(axes) != 1 else axes[0]


def _as_bits(x):
    """``x`` as unsigned integers of at least 32 bits (CPU collectives add uint32) and the way back."""
    dt = x.dtype
    width = jnp.dtype(dt).itemsize
    if width > 4:
        raise TypeError(f"exact_sum: {dt} is wider than 32 bits")
    bits = jax.lax.bitcast_convert_type(x, _UINT[width]).astype(jnp.uint32)
    return bits, lambda b: jax.lax.bitcast_convert_type(b.astype(_UINT[width]), dt)


def exact_sum(x, axes: tuple[str, ...]):
    """``psum(x, axes)`` for ``x`` non-zero on at most one device per element, bit-exact."""
    if not axes:
        return x
    bits, back = _as_bits(x)
    return back(jax.lax.psum(bits, axis_name(axes)))


def exact_sum_scatter(x, axes: tuple[str, ...]):
    """``psum_scatter(x, axes, scatter_dimension=0, tiled=True)`` for ``x`` non-zero on at most
    one device per element, bit-exact: device ``k`` of the group gets rows ``[k*n/g, (k+1)*n/g)``
    of the sum."""
    if not axes:
        return x
    bits, back = _as_bits(x)
    return back(jax.lax.psum_scatter(bits, axis_name(axes), scatter_dimension=0, tiled=True))


def gather_rows(table_local, ids, axes: tuple[str, ...]):
    """``table[ids]`` (``jnp.take`` on axis 0) where ``table``'s rows are split evenly over the
    manual ``axes`` in their order and this device holds ``table_local``. Every device of the
    group must call it (the same ``ids`` shape)."""
    if not axes:
        return jnp.take(table_local, ids, axis=0)
    rows = table_local.shape[0]
    me = jax.lax.axis_index(axis_name(axes))
    all_ids = jax.lax.all_gather(ids, axis_name(axes))               # [n, *ids.shape]
    local = all_ids.astype(jnp.int32) - me * rows
    mine = (local >= 0) & (local < rows)
    got = jnp.take(table_local, jnp.where(mine, local, 0), axis=0)
    got = jnp.where(mine.reshape(mine.shape + (1,) * (got.ndim - mine.ndim)), got, jnp.zeros((), got.dtype))
    return exact_sum_scatter(got, axes)[0]                       # this device's [*ids.shape, ...]
