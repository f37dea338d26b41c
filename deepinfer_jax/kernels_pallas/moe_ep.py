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
moves what the psum's all-gather half does. In the attention-DP step (``moe_experts_dp``) the
tokens are already split over ``dp`` and that all-gather spans only a rank's cp devices.
``scripts/ep_comm_model.py`` tabulates both at DeepInfer's shapes.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from deepinfer_jax.sharding import context_parallel, manual
from deepinfer_jax.sharding.partition import split_axes
from deepinfer_jax.sharding.ragged_a2a import native_supported, ragged_all_to_all

SCHEMES = ("psum", "a2a")


def expert_axes(mesh, n_experts: int) -> tuple[str, ...]:
    """The mesh axes the expert dim of the stacked weights is split over on ``mesh`` (as
    ``partition.py`` places them), as a tuple; ``()`` when the experts are replicated."""
    return split_axes("expert", mesh, n_experts)


def context_mesh():
    """The mesh set with ``jax.set_mesh`` around the trace (what the engine's runner does on a
    multi-device mesh), or ``None``; also ``None`` inside ``shard_map`` (the attention-DP step:
    there each device already holds its local experts, ``moe_experts_dp``)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or manual.manual_axes():
        return None
    return mesh


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
    ax = manual.axis_name(axes)
    if scheme == "a2a":
        return moe_experts_a2a(local_fn, x_TD, idx_TX, weight_TX, w1, w2, w3, fmt, swiglu_limit, n_experts,
                               mesh=mesh, axes=axes)

    def body(x, idx, wt, w1_, w2_, w3_):
        local, _ = _local_ids(idx, ax, e_local)
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
    ax = manual.axis_name(axes)
    native = native_supported(jax.default_backend())
    T = idx_TX.shape[0]
    Tn = -(-T // n)              # tokens per device's slice (the last one padded)

    def body(x, idx, wt, w1_, w2_, w3_):
        me = jax.lax.axis_index(ax)
        x_N, idx_N, wt_N = _my_slice(me, Tn, n, x, idx, wt)
        out = _a2a_exchange(local_fn, x_N, idx_N, wt_N, w1_, w2_, w3_, fmt, swiglu_limit, n_experts, n=n, ax=ax,
                            native=native)
        return jax.lax.all_gather(out, ax, tiled=True)[:T]

    def wspec(w):
        return tuple(None if a is None else P(ax) for a in w)

    return jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(), wspec(w1), wspec(w2), wspec(w3)),
                         out_specs=P(), check_vma=False)(x_TD, idx_TX, weight_TX, w1, w2, w3)


def _local_ids(idx, ax, e_local: int):
    """Routing ids in this device's numbering of its ``e_local`` experts (device ``i`` of ``ax``
    holds ``[i*e_local, (i+1)*e_local)``), ``-1`` for the others', and the mask of its own."""
    local = idx.astype(jnp.int32) - jax.lax.axis_index(ax) * e_local
    mine = (idx >= 0) & (local >= 0) & (local < e_local)
    return jnp.where(mine, local, -1), mine


def _my_slice(me, Tn: int, n: int, x, idx, wt):
    """Rows ``[me*Tn, (me+1)*Tn)`` of the tokens padded to ``n*Tn`` (padding routes nowhere)."""
    pad = Tn * n - x.shape[0]
    x = jnp.pad(x, ((0, pad), (0, 0)))
    idx = jnp.pad(idx.astype(jnp.int32), ((0, pad), (0, 0)), constant_values=-1)
    wt = jnp.pad(wt, ((0, pad), (0, 0)))
    return tuple(jax.lax.dynamic_slice_in_dim(a, me * Tn, Tn) for a in (x, idx, wt))


def _a2a_exchange(local_fn: Callable, x_ND, idx_NX, wt_NX, w1, w2, w3, fmt: str, swiglu_limit: float,
                  n_experts: int, *, n: int, ax, native: bool) -> jax.Array:
    """This device's ``N`` tokens through the experts split over the ``n`` devices of ``ax``:
    each (token, slot) entry goes to the device owning its expert (``ragged_all_to_all``), the
    owner runs ``local_fn`` on its local experts and the result rows come back to where they
    were sent from. Returns ``[N, X, D]``; entries routed nowhere (id -1) are zero."""
    e_local = n_experts // n
    N, X = idx_NX.shape
    A = N * X                    # (token, slot) entries this device sends at most
    me = jax.lax.axis_index(ax)
    e_A = idx_NX.astype(jnp.int32).reshape(A)
    w_A = wt_NX.reshape(A)
    valid = (e_A >= 0) & (e_A < n_experts)
    dest_A = jnp.where(valid, e_A // e_local, n)       # n: sent nowhere (contributes zeros)
    order = jnp.argsort(dest_A, stable=True)           # stable: every expert's rows keep token order
    send_n = jnp.bincount(dest_A, length=n + 1)[:n].astype(jnp.int32)
    sizes_NN = jax.lax.all_gather(send_n, ax)           # [sender, receiver]
    in_off = jnp.cumsum(send_n) - send_n
    out_off = (jnp.cumsum(sizes_NN, axis=0) - sizes_NN)[me]   # my chunk's place at each receiver
    recv_n = sizes_NN[:, me]
    back_off = (jnp.cumsum(sizes_NN, axis=1) - sizes_NN)[:, me]  # where each sender keeps my chunk
    a2a = lambda op, out, io, ss, oo, rs: ragged_all_to_all(op, out, io, ss, oo, rs, axis_name=ax, native=native)
    local_A = jnp.where(valid, e_A - dest_A * e_local, -1)[order]
    rows = n * A
    rx = a2a(x_ND[order // X], jnp.zeros((rows, x_ND.shape[1]), x_ND.dtype), in_off, send_n, out_off, recv_n)
    re = a2a(local_A[:, None], jnp.full((rows, 1), -1, jnp.int32), in_off, send_n, out_off, recv_n)
    rw = a2a(w_A[order][:, None], jnp.zeros((rows, 1), wt_NX.dtype), in_off, send_n, out_off, recv_n)
    y = local_fn(rx, re, rw, w1, w2, w3, fmt, swiglu_limit, e_local)[:, 0]   # [rows, D]
    r_off = jnp.cumsum(recv_n) - recv_n
    back = a2a(y, jnp.zeros((A, y.shape[-1]), y.dtype), r_off, recv_n, back_off, send_n)
    out_A = jnp.zeros_like(back).at[order].set(back)    # entries sent nowhere stay zero
    return out_A.reshape(N, X, -1)


# ---------------------------------------------------------------- inside the attention-DP step
_SCHEME: contextvars.ContextVar[str] = contextvars.ContextVar("deepinfer_ep_scheme", default="a2a")


@contextlib.contextmanager
def use_scheme(scheme: str):
    """The EP scheme of ``moe_experts_dp`` for traces inside this block (the DP runner's
    ``EngineConfig.ep_scheme``; a static argument of its compiled step)."""
    if scheme not in SCHEMES:
        raise ValueError(f"ep_scheme={scheme!r}: expected one of {SCHEMES}")
    tok = _SCHEME.set(scheme)
    try:
        yield
    finally:
        _SCHEME.reset(tok)


def current_scheme() -> str:
    return _SCHEME.get()


def moe_experts_dp(local_fn: Callable, x_TD, idx_TX, weight_TX, w1, w2, w3, fmt: str, swiglu_limit: float,
                   n_experts: int, *, scheme: str | None = None) -> jax.Array:
    """The routed experts inside the attention-DP step, where every mesh axis is manual: the
    ``T`` tokens are this dp rank's own (the same on each device of its cp group, or, in a
    context-parallel step, this device's own share of them), the expert
    weights are this device's ``E / n`` local experts. Same ``[T, X, D]`` as ``local_fn`` over
    all experts on one device, bit for bit, under either scheme:

    * ``"a2a"``: the dp rank's tokens are split over its cp devices (each sends a distinct
      share), every (token, slot) goes only to the device owning its expert and comes back
      (``_a2a_exchange``), and an all-gather over cp rebuilds the rank's ``[T, X, D]``.
    * ``"psum"`` (the reference): every device gathers all ranks' tokens, computes its experts'
      entries of all of them and an exact sum-scatter returns each rank its rows.
    """
    scheme = current_scheme() if scheme is None else scheme
    if scheme not in SCHEMES:
        raise ValueError(f"moe_experts_dp: scheme={scheme!r}: expected one of {SCHEMES}")
    mesh = jax.sharding.get_abstract_mesh()
    e_axes = split_axes("expert", mesh, n_experts)
    if not e_axes:
        return local_fn(x_TD, idx_TX, weight_TX, w1, w2, w3, fmt, swiglu_limit, n_experts)
    n = manual.axes_size(e_axes)
    e_ax = manual.axis_name(e_axes)
    # tokens differ over dp, and over cp in a context-parallel step (sharding/context_parallel.py)
    differ = ("dp",) + context_parallel.split_axes()
    tok_axes = tuple(a for a in mesh.axis_names if a in differ and mesh.shape[a] > 1)
    rep_axes = tuple(a for a in manual.manual_axes() if a not in tok_axes and mesh.shape[a] > 1)
    if scheme == "a2a":
        m = manual.axes_size(rep_axes) if rep_axes else 1
        T = x_TD.shape[0]
        Tn = -(-T // m)
        me = jax.lax.axis_index(manual.axis_name(rep_axes)) if rep_axes else 0
        x_N, idx_N, wt_N = _my_slice(me, Tn, m, x_TD, idx_TX, weight_TX)
        out = _a2a_exchange(local_fn, x_N, idx_N, wt_N, w1, w2, w3, fmt, swiglu_limit, n_experts, n=n, ax=e_ax,
                            native=native_supported(jax.default_backend()))
        if rep_axes:
            out = jax.lax.all_gather(out, manual.axis_name(rep_axes), tiled=True)
        return out[:T]
    # psum: all ranks' tokens on every device, own experts' entries, exact sum back to the owners
    T = x_TD.shape[0]
    gather = (lambda a: jax.lax.all_gather(a, manual.axis_name(tok_axes), tiled=True)) \
        if tok_axes else (lambda a: a)
    x_G, idx_G, wt_G = gather(x_TD), gather(idx_TX.astype(jnp.int32)), gather(weight_TX)
    e_local = n_experts // n
    local, mine = _local_ids(idx_G, e_ax, e_local)
    y = local_fn(x_G, local, wt_G, w1, w2, w3, fmt, swiglu_limit, e_local)
    y = jnp.where(mine[..., None], y, jnp.zeros((), y.dtype))        # exact zeros off the owner
    sum_axes = tuple(a for a in e_axes if a not in tok_axes)
    scatter_axes = tuple(a for a in tok_axes if a in e_axes)
    y = manual.exact_sum(y, sum_axes)
    if scatter_axes == tok_axes:   # each token group's rows summed onto its own devices
        return manual.exact_sum_scatter(y, scatter_axes)
    y = manual.exact_sum(y, scatter_axes)   # experts not split over every token axis: all rows
    k = jax.lax.axis_index(manual.axis_name(tok_axes))
    return jax.lax.dynamic_slice_in_dim(y, k * T, T)
