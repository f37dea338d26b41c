"""Pure-jnp reference of the mHC Sinkhorn iterations (``layers/mhc.py``).

``n`` alternating normalisations of ``comb [T, C, C]`` (fp32): rows to sum 1 (``+ eps`` in the
denominator), then columns, ``n`` times, as the reference model does after its first step.

The arithmetic is written on the ``C*C`` entries as separate vectors over the tokens
(``entries``): each row's and column's sum adds its ``C`` entries left to right, and each entry
is divided by its sum. Written on ``[T, C, C]`` arrays, XLA's algebraic simplifier turns
``c / broadcast(s)`` into ``c * broadcast(1 / s)`` (a reciprocal and a product: other bits than
the division the reference model makes), and ``(c / s1) / s2`` into ``c / (s1 * s2)`` (``exact``
prevents that), and reduces in a backend-dependent order; one fp32 ulp
here moved near-tied greedy tokens of the golden random-weight model. ``sinkhorn_iterate_np`` is
the arithmetic itself in numpy (fp32, IEEE division): XLA on the CPU and the compiled Pallas
kernel (``sinkhorn.py``, which runs the same ``step``) compute its bits; XLA's GPU code for this
reference does not (``scripts/kernel_bench/sinkhorn_bits_probe.py`` measures how far it lands).
"""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
import numpy as np


def entries(c_TCC: jax.Array) -> tuple:
    """``[T, C, C]`` -> the ``C*C`` entry vectors ``[T]``, row-major (``v[i*C + j] = c[:, i, j]``)."""
    T, C, _ = c_TCC.shape
    flat = c_TCC.reshape(T, C * C)
    return tuple(flat[:, k] for k in range(C * C))


def from_entries(v: tuple, C: int) -> jax.Array:
    return jnp.stack(v, axis=-1).reshape(-1, C, C)


def _sum(terms):
    acc = terms[0]
    for t in terms[1:]:
        acc = acc + t
    return acc


def normalise_rows(v: tuple, C: int, eps: float, eps_after: bool = False, div=operator.truediv) -> tuple:
    """Each row's entries divided by the row's left-to-right sum: ``v / (s + eps)``, or with
    ``eps_after`` (the softmax rows of the first step) ``v / s + eps``. ``div``: the division
    (a kernel passes its IEEE round-to-nearest one)."""
    out = list(v)
    for i in range(C):
        s = _sum([v[i * C + j] for j in range(C)])
        for j in range(C):
            out[i * C + j] = div(v[i * C + j], s) + eps if eps_after else div(v[i * C + j], s + eps)
    return tuple(out)


def normalise_cols(v: tuple, C: int, eps: float, div=operator.truediv) -> tuple:
    out = list(v)
    for j in range(C):
        s = _sum([v[i * C + j] for i in range(C)])
        for i in range(C):
            out[i * C + j] = div(v[i * C + j], s + eps)
    return tuple(out)


def exact(v: tuple) -> tuple:
    """``v`` behind an optimization barrier: XLA's algebraic simplifier rewrites ``(a / b) / c``
    into ``a / (b * c)`` (other bits), and a row normalisation followed by a column one is that
    pattern; the barrier keeps the two divisions."""
    return jax.lax.optimization_barrier(v)


def step(v: tuple, C: int, eps: float, barrier: bool = True, div=operator.truediv) -> tuple:
    """One Sinkhorn step on the entry vectors: rows, then columns (``barrier``: see ``exact``;
    a compiled Pallas kernel has no such rewrite and no barrier lowering, and passes False)."""
    fence = exact if barrier else (lambda x: x)
    return fence(normalise_cols(fence(normalise_rows(v, C, eps, div=div)), C, eps, div=div))


def first_step(v: tuple, C: int, eps: float, barrier: bool = True, div=operator.truediv) -> tuple:
    """The first Sinkhorn step of ``mhc.sinkhorn_split`` on the entry vectors of the softmax
    numerators: rows ``c / sum + eps``, then columns ``c / (sum + eps)`` (``barrier``, ``div``:
    as in ``step``)."""
    fence = exact if barrier else (lambda x: x)
    return fence(normalise_cols(fence(normalise_rows(v, C, eps, eps_after=True, div=div)), C, eps, div=div))


def first_step_ref(comb_TCC: jax.Array, eps: float) -> jax.Array:
    """``first_step`` on ``[..., C, C]``."""
    C = comb_TCC.shape[-1]
    lead = comb_TCC.shape[:-2]
    v = first_step(entries(comb_TCC.reshape(-1, C, C)), C, eps)
    return from_entries(v, C).reshape(*lead, C, C)


def sinkhorn_iterate_ref(comb_TCC: jax.Array, n: int, eps: float) -> jax.Array:
    """``n`` Sinkhorn steps on fp32 ``comb [T, C, C]`` (a loop, not ``2n`` unrolled ops)."""
    c = comb_TCC.astype(jnp.float32)
    C = c.shape[-1]
    lead = c.shape[:-2]
    v = entries(c.reshape(-1, C, C))
    v = jax.lax.fori_loop(0, n, lambda _, x: step(x, C, eps), v)
    return from_entries(v, C).reshape(*lead, C, C)


def sinkhorn_ref(comb_TCC: jax.Array, iters: int, eps: float, iterate=None) -> jax.Array:
    """The whole mHC Sinkhorn (``ops.sinkhorn``'s reference) on the softmax numerators: the jnp
    first step, then ``iters - 1`` steps by ``iterate`` (default ``sinkhorn_iterate_ref``)."""
    return (iterate or sinkhorn_iterate_ref)(first_step_ref(comb_TCC, eps), max(iters - 1, 0), eps)


def sinkhorn_iterate_np(comb_TCC, n: int, eps: float) -> np.ndarray:
    """The oracle: ``n`` steps in numpy fp32 (rows ``c / (sum + eps)``, then columns; each sum
    left to right, each division IEEE round-to-nearest)."""
    c = np.array(comb_TCC, np.float32)
    eps = np.float32(eps)
    C = c.shape[-1]
    for _ in range(n):
        s = c[..., :, 0:1]
        for j in range(1, C):
            s = s + c[..., :, j:j + 1]
        c = c / (s + eps)
        s = c[..., 0:1, :]
        for i in range(1, C):
            s = s + c[..., i:i + 1, :]
        c = c / (s + eps)
    return c


def first_step_np(comb_TCC, eps: float) -> np.ndarray:
    """The oracle of ``first_step``: rows ``c / sum + eps``, then columns ``c / (sum + eps)``."""
    c = np.array(comb_TCC, np.float32)
    eps = np.float32(eps)
    C = c.shape[-1]
    s = c[..., :, 0:1]
    for j in range(1, C):
        s = s + c[..., :, j:j + 1]
    c = c / s + eps
    s = c[..., 0:1, :]
    for i in range(1, C):
        s = s + c[..., i:i + 1, :]
    return c / (s + eps)


def sinkhorn_np(comb_TCC, iters: int, eps: float) -> np.ndarray:
    """The oracle of the whole mHC Sinkhorn (``ops.sinkhorn``): the first step on the softmax
    numerators, then ``iters - 1`` steps."""
    return sinkhorn_iterate_np(first_step_np(comb_TCC, eps), max(iters - 1, 0), eps)
