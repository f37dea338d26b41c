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

The all-reduce moves ``T * X * D`` bf16 per device per layer. ``scheme="a2a"`` (``moe_experts_a2a``)
sends each (token, slot) only to the device owning its expert instead:

* device ``d`` takes the ``d``-th slice of the (replicated) tokens, sorts its (token, slot)
  entries by owning device (stable: token order is kept), and ``ragged_all_to_all``
  (``sharding/ragged_a2a.py``) sends each device its rows, their local expert ids and routing
  weights; the owner runs ``local_fn`` on what it received (every row of one expert arrives in
  the token order the psum path's device sees, so the grouped products match it);
* a second ``ragged_all_to_all`` returns each result row to the device and offset it came from,
  and an ``all_gather`` of the ``[T / n, X, D]`` slices rebuilds the replicated output.

Its dispatch and combine move ``2 * T * X * D / n`` rows' bytes per device; the final all-gather
moves what the psum's all-gather half does, and disappears once tokens are split over ``dp``
(the caller then keeps its slice). ``scripts/ep_comm_model.py`` tabulates both at DeepInfer's
shapes.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from deepinfer_jax.sharding.partition import logical_to_spec
from deepinfer_jax.sharding.ragged_a2a import native_supported, ragged_all_to_all

SCHEMES = ("psum", "a2a")


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
                   n_experts: int, *, mesh=None, scheme: str = "psum") -> jax.Array:
    """``local_fn`` (signature of ``moe_gmm_ref.moe_experts_ref``) over the experts split on
    ``mesh`` (default: the context mesh). Same result as ``local_fn`` on one device.
    ``scheme``: ``"psum"`` (every device computes its experts' rows of all tokens, an all-reduce
    adds them) or ``"a2a"`` (tokens go only to their experts' devices; bit-identical output)."""
    if scheme not in SCHEMES:
        raise ValueError(f"moe_experts_ep: scheme={scheme!r}: expected one of {SCHEMES}")
    mesh = mesh if mesh is not None else context_mesh()
    axes = expert_axes(mesh, n_experts) if mesh is not None else ()
    if not axes:
        return local_fn(x_TD, idx_TX, weight_TX, w1, w2, w3, fmt, swiglu_limit, n_experts)
    n_shards = math.prod(mesh.shape[a] for a in axes)
    e_local = n_experts // n_shards
    ax = axes if len(axes) > 1 else axes[0]
    if scheme == "a2a":
        return moe_experts_a2a(local_fn, x_TD, idx_TX, weight_TX, w1, w2, w3, fmt, swiglu_limit, n_experts,
                               mesh=mesh, axes=axes)

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


def moe_experts_a2a(local_fn: Callable, x_TD, idx_TX, weight_TX, w1, w2, w3, fmt: str, swiglu_limit: float,
                    n_experts: int, *, mesh, axes: tuple[str, ...]) -> jax.Array:
    """The all-to-all scheme of ``moe_experts_ep`` (module docstring): replicated ``[T, X, D]`` out."""
    n = math.prod(mesh.shape[a] for a in axes)
    e_local = n_experts // n
    ax = axes if len(axes) > 1 else axes[0]
    native = native_supported(jax.default_backend())
    T, X = idx_TX.shape
    Tn = -(-T // n)              # tokens per device's slice (the last one padded)
    A = Tn * X                   # (token, slot) entries a device sends at most
    pad = Tn * n - T

    def body(x, idx, wt, w1_, w2_, w3_):
        me = jax.lax.axis_index(ax)
        x = jnp.pad(x, ((0, pad), (0, 0)))
        idx = jnp.pad(idx.astype(jnp.int32), ((0, pad), (0, 0)), constant_values=-1)
        wt = jnp.pad(wt, ((0, pad), (0, 0)))
        x_ND = jax.lax.dynamic_slice_in_dim(x, me * Tn, Tn)
        e_A = jax.lax.dynamic_slice_in_dim(idx, me * Tn, Tn).reshape(A)
        w_A = jax.lax.dynamic_slice_in_dim(wt, me * Tn, Tn).reshape(A)
        valid = (e_A >= 0) & (e_A < n_experts)
        dest_A = jnp.where(valid, e_A // e_local, n)       # n: sent nowhere (contributes zeros)
        order = jnp.argsort(dest_A, stable=True)
        send_n = jnp.bincount(dest_A, length=n + 1)[:n].astype(jnp.int32)
        sizes_NN = jax.lax.all_gather(send_n, ax)           # [sender, receiver]
        in_off = jnp.cumsum(send_n) - send_n
        out_off = (jnp.cumsum(sizes_NN, axis=0) - sizes_NN)[me]   # my chunk's place at each receiver
        recv_n = sizes_NN[:, me]
        back_off = (jnp.cumsum(sizes_NN, axis=1) - sizes_NN)[:, me]  # where each sender keeps my chunk
        a2a = lambda op, out, io, ss, oo, rs: ragged_all_to_all(op, out, io, ss, oo, rs, axis_name=ax, native=native)
        local_A = jnp.where(valid, e_A - dest_A * e_local, -1)[order]
        rows = n * A
        rx = a2a(x_ND[order // X], jnp.zeros((rows, x.shape[1]), x.dtype), in_off, send_n, out_off, recv_n)
        re = a2a(local_A[:, None], jnp.full((rows, 1), -1, jnp.int32), in_off, send_n, out_off, recv_n)
        rw = a2a(w_A[order][:, None], jnp.zeros((rows, 1), wt.dtype), in_off, send_n, out_off, recv_n)
        y = local_fn(rx, re, rw, w1_, w2_, w3_, fmt, swiglu_limit, e_local)[:, 0]   # [rows, D]
        r_off = jnp.cumsum(recv_n) - recv_n
        back = a2a(y, jnp.zeros((A, y.shape[-1]), y.dtype), r_off, recv_n, back_off, send_n)
        out_A = jnp.zeros_like(back).at[order].set(back)    # entries sent nowhere stay zero
        return jax.lax.all_gather(out_A.reshape(Tn, X, -1), ax, tiled=True)[:T]

    def wspec(w):
        return tuple(None if a is None else P(ax) for a in w)

    return jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(), wspec(w1), wspec(w2), wspec(w3)),
                         out_specs=P(), check_vma=False)(x_TD, idx_TX, weight_TX, w1, w2, w3)
