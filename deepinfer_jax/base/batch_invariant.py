"""Batch-invariant numerics (``EngineConfig.batch_invariant``): ops whose result for one token
(one request row) does not depend on the other tokens of the step or on the padded step size.

Where XLA's defaults depend on the batch (found by bisecting one prompt at T=50 vs a padded
T=64, layer by layer, on the CPU):

* reductions: ``jnp.sum`` over a short trailing axis is vectorised across the kept axes, and
  the grouping of the adds changes with the kept size (the attention softmax denominator over
  16 entries differed in half its rows between T=50 and T=64). ``max`` / ``min`` / ``argmax``
  are exact in any order and need nothing.
* matmuls: a one-row product takes XLA CPU's matrix-vector path, which adds along the
  contracted dimension in another order than the matrix-matrix path (bf16 ``[1, K] @ [K, N]``
  differs from row 0 of ``[64, K] @ [K, N]``); GPU GEMM libraries pick tiles and split-K by M.

Here, while ``use(True)`` is active at trace time (the runner does this with its static
``batch_invariant`` argument, as ``kernels_pallas/ops.use_backend`` does for the kernels):

* ``row_sum`` / ``row_mean`` / ``softmax`` / ``logsumexp`` / ``log_softmax`` reduce with a fixed
  pairwise tree of elementwise adds (the axis zero-padded to a power of two, then halved), so
  each output's add order depends only on the reduced length;
* ``rowwise(fn, ...)`` evaluates a row-wise ``fn`` (a matmul) on fixed tiles of ``ROW_TILE``
  rows, one after another (``lax.map``), so every product XLA compiles has the same shape
  whatever the step's token count; the contracted dimension is never split across tiles.

Outside ``use(True)`` every function is the plain jnp op (the default path keeps its speed).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable

import jax
import jax.numpy as jnp

ROW_TILE = 32  # rows per product in batch-invariant mode (padded up to a multiple)
ENV = "DEEPINFER_BATCH_INVARIANT"

_ON: contextvars.ContextVar[bool] = contextvars.ContextVar("deepinfer_batch_invariant", default=False)


@contextlib.contextmanager
def use(on: bool):
    """Ops traced inside run batch-invariant (``on``) or the plain jnp ops."""
    token = _ON.set(bool(on))
    try:
        yield
    finally:
        _ON.reset(token)


def enabled() -> bool:
    return _ON.get()


def compiler_options(platform: str) -> dict | None:
    """XLA options of a batch-invariant step's compile on ``platform`` (None: none needed).

    On the GPU, XLA's autotuner times candidate GEMM configurations (tiles, split-K) for every
    product of each compile and keeps the fastest, so two compiled step variants can run the same
    ``ROW_TILE``-row product with different reduction orders. On the H200 with the jnp references
    (``scripts/batch_invariance_probe.py``), the default autotuner broke the invariance (a request
    alone vs in a batch of 41: logprobs off by up to 5.1, tokens differing), and
    ``xla_gpu_autotune_level=0`` (configurations picked by shape alone) made all checked requests
    bit-identical. The option is per compile: the plain steps keep the autotuner."""
    if platform in ("gpu", "cuda", "rocm"):
        return {"xla_gpu_autotune_level": 0}
    return None


# --------------------------------------------------------------------------- reductions


def tree_sum(x: jax.Array, axis: int = -1, keepdims: bool = False) -> jax.Array:
    """Sum along ``axis`` by a fixed pairwise tree of elementwise adds (always, whatever the mode)."""
    axis = axis % x.ndim
    n = x.shape[axis]
    if n == 0:
        return jnp.sum(x, axis=axis, keepdims=keepdims)
    p = 1 << (n - 1).bit_length()
    if p != n:
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, p - n)
        x = jnp.pad(x, pad)
    while p > 1:
        p //= 2
        x = jax.lax.slice_in_dim(x, 0, p, axis=axis) + jax.lax.slice_in_dim(x, p, 2 * p, axis=axis)
    return x if keepdims else jnp.squeeze(x, axis)


def row_sum(x: jax.Array, axis: int = -1, keepdims: bool = False) -> jax.Array:
    return tree_sum(x, axis, keepdims) if enabled() else jnp.sum(x, axis=axis, keepdims=keepdims)


def row_mean(x: jax.Array, axis: int = -1, keepdims: bool = False) -> jax.Array:
    if not enabled():
        return jnp.mean(x, axis=axis, keepdims=keepdims)
    return tree_sum(x, axis, keepdims) / jnp.asarray(x.shape[axis], x.dtype)


def softmax(x: jax.Array, axis: int = -1) -> jax.Array:
    if not enabled():
        return jax.nn.softmax(x, axis=axis)
    m = jnp.max(x, axis=axis, keepdims=True)
    e = jnp.exp(x - jnp.where(jnp.isfinite(m), m, 0))
    return e / tree_sum(e, axis, keepdims=True)


def logsumexp(x: jax.Array, axis: int = -1, keepdims: bool = False) -> jax.Array:
    if not enabled():
        return jax.nn.logsumexp(x, axis=axis, keepdims=keepdims)
    m = jax.lax.stop_gradient(jnp.max(x, axis=axis, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0)
    out = jnp.log(tree_sum(jnp.exp(x - m), axis, keepdims=True)) + m
    return out if keepdims else jnp.squeeze(out, axis % x.ndim)


def log_softmax(x: jax.Array, axis: int = -1) -> jax.Array:
    if not enabled():
        return jax.nn.log_softmax(x, axis=axis)
    return x - logsumexp(x, axis, keepdims=True)


# --------------------------------------------------------------------------- row-tiled products


def rowwise(fn: Callable, *xs: jax.Array, consts: tuple = (), tile: int = ROW_TILE):
    """``fn(*xs, *consts)`` for a ``fn`` that maps the leading rows of ``xs`` to leading rows
    independently (a matmul; ``consts``: its operands without rows, e.g. the weight). In
    batch-invariant mode it runs on zero-padded tiles of ``tile`` rows in sequence, so the
    compiled product has one shape for every step size."""
    if not enabled():
        return fn(*xs, *consts)
    T = xs[0].shape[0]
    n = max(1, -(-T // tile))
    padded = tuple(jnp.pad(x, [(0, n * tile - T)] + [(0, 0)] * (x.ndim - 1)) for x in xs)
    return _tile_loop(lambda i, args, cs: fn(*args, *cs), n, tile, padded, T, consts)


def _tile_loop(body: Callable, n: int, tile: int, padded: tuple, T: int, consts: tuple = ()):
    """``body(i, tiles, consts)`` for tiles ``i = 0..n-1`` of ``tile`` rows of the ``padded``
    arrays, in a loop whose trip count XLA does not see (a loop of one tile is not inlined into
    the step). ``consts`` reach the body through an optimization barrier: XLA cannot fold a
    transpose of the weight into the product in one compile and not in another (it did: the
    same ``[32, 512] @ [512, 24]`` tile contracted a transposed weight at T=16 and a
    materialised one at T=64, and the sums differed)."""
    def piece(i):
        return tuple(jax.lax.dynamic_slice_in_dim(x, i * tile, tile) for x in padded)

    out_shape = jax.eval_shape(lambda a, c: body(0, a, c), piece(0), consts)
    init = jax.tree.map(lambda s: jnp.zeros((n * tile, *s.shape[1:]), s.dtype), out_shape)

    def step(i, acc):
        y = body(i, piece(i), jax.lax.optimization_barrier(consts))
        return jax.tree.map(lambda a, b: jax.lax.dynamic_update_slice_in_dim(a, b, i * tile, 0), acc, y)

    trips = jax.lax.optimization_barrier(jnp.int32(n))
    out = jax.lax.fori_loop(0, trips, step, init)
    return jax.tree.map(lambda y: y[:T], out)


def matmul(x: jax.Array, w: jax.Array, **kw) -> jax.Array:
    """``jnp.matmul(x, w, **kw)`` with ``x`` [rows, K] (row-tiled in batch-invariant mode)."""
    return rowwise(lambda a, w: jnp.matmul(a, w, **kw), x, consts=(w,))


def ragged_dot(x_MK: jax.Array, w_EKN: jax.Array, group_sizes_E: jax.Array, **kw) -> jax.Array:
    """``lax.ragged_dot`` over rows sorted by group; in batch-invariant mode on fixed row tiles,
    each with the sizes of the groups' parts inside it."""
    if not enabled():
        return jax.lax.ragged_dot(x_MK, w_EKN, group_sizes_E, **kw)
    M = x_MK.shape[0]
    n = max(1, -(-M // ROW_TILE))
    ends = jnp.cumsum(group_sizes_E)
    starts = ends - group_sizes_E
    lo = (jnp.arange(n) * ROW_TILE)[:, None]
    sizes_nE = (jnp.clip(ends[None] - lo, 0, ROW_TILE) - jnp.clip(starts[None] - lo, 0, ROW_TILE)).astype(group_sizes_E.dtype)
    xt = jnp.pad(x_MK, ((0, n * ROW_TILE - M), (0, 0)))
    def body(i, a, c):
        return jax.lax.ragged_dot(a[0], c[0], jax.lax.dynamic_index_in_dim(c[1], i, keepdims=False), **kw)

    return _tile_loop(body, n, ROW_TILE, (xt,), M, (w_EKN, sizes_nE))
