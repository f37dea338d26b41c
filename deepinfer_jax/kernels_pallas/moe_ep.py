"""Expert parallelism for a per-device routed-expert implementation (``shard_map``).

Inside a jitted step on a mesh, the stacked expert weights are split over the expert-parallel
group (logical axis ``"expert"``, see ``sharding/partition.py``: the flattened ``dp x cp`` axes,
or the largest sub-group dividing the expert count). A Pallas kernel is a custom call that GSPMD
cannot partition: left to GSPMD it would gather every expert onto every device. ``moe_experts_ep``
instead runs the per-device implementation under ``shard_map``:

* each device receives all ``T`` tokens and their routing (replicated operands: GSPMD gathers
  tokens that were split over ``dp``) and its ``E / n`` local experts' weights, unmoved;
* routing ids are shifted to local numbering; ids owned by other devices become ``-1``, which
  the implementations already turn into zero rows;
* a ``psum`` over the expert axes adds the per-device ``[T, X, D]`` results. Every (token, slot)
  entry is non-zero on exactly one device and ``0 + v = v``, so the sum is exact (no rounding).

The all-reduce moves ``T * X * D`` bf16 per device per layer; an all-to-all dispatch (send each
token only to the devices owning its experts) moves ~``X / n`` of that and is the next step for
large expert-parallel groups.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from deepinfer_jax.sharding.partition import logical_to_spec


def expert_axes(mesh, n_experts: int) -> tuple[str, ...]:
    """The mesh axes the expert dim of the stacked weights is split over on ``mesh`` (as
    ``partition.py`` places them), as a tuple; ``()`` when the experts are replicated."""
    spec = logical_to_spec(("expert",), mesh, (n_experts,))
    axes = spec[0] if len(spec) else None
    if axes is None:
        return ()
    return tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)


def context_mesh():
    """The mesh set with ``jax.set_mesh`` around the trace (what the engine's runner does on a
    multi-device mesh), or ``None``."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh is None or mesh.empty else mesh


def moe_experts_ep(local_fn: Callable, x_TD, idx_TX, weight_TX, w1, w2, w3, fmt: str, swiglu_limit: float,
                   n_experts: int, *, mesh=None) -> jax.Array:
    """``local_fn`` (signature of ``moe_gmm_ref.moe_experts_ref``) over the experts split on
    ``mesh`` (default: the context mesh). Same result as ``local_fn`` on one device."""
    mesh = mesh if mesh is not None else context_mesh()
    axes = expert_axes(mesh, n_experts) if mesh is not None else ()
    if not axes:
        return local_fn(x_TD, idx_TX, weight_TX, w1, w2, w3, fmt, swiglu_limit, n_experts)
    n_shards = math.prod(mesh.shape[a] for a in axes)
    e_local = n_experts // n_shards
    ax = axes if len(axes) > 1 else axes[0]

    def body(x, idx, wt, w1_, w2_, w3_):
        first = jax.lax.axis_index(ax) * e_local
        local = idx.astype(jnp.int32) - first
        local = jnp.where((idx >= 0) & (local >= 0) & (local < e_local), local, -1)
        y = local_fn(x, local, wt, w1_, w2_, w3_, fmt, swiglu_limit, e_local)
        return jax.lax.psum(y, ax)

    def wspec(w):
        return tuple(None if a is None else P(ax) for a in w)

    return jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(), wspec(w1), wspec(w2), wspec(w3)),
                         out_specs=P(), check_vma=False)(x_TD, idx_TX, weight_TX, w1, w2, w3)
