"""mHC: the residual stream as ``C = hc_mult`` copies, mixed by Sinkhorn-normalised matrices.

Per sub-layer (attention or MoE) three parameter tensors: ``fn [Z, C*D]`` fp32, ``base [Z]``,
``scale [3]`` with ``Z = (2 + C) * C``. From the sub-layer's input stream X the mixes are
``m = (flat(X) fn^T) * rsqrt(mean(flat(X)^2) + eps)``; ``pre`` (collapse weights), ``post``
(expand weights) and ``comb`` (doubly-stochastic C x C matrix, Sinkhorn) are split from m.
V4.1 is *delayed*: a sub-layer collapses with the ``pre`` computed one sub-layer earlier.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from deepinfer_jax.base import batch_invariant as bi
from deepinfer_jax.kernels_pallas import ops, sinkhorn_ref
from deepinfer_jax.layers.linear import HIGHEST


def sinkhorn_split(m_TZ: jax.Array, scale_3: jax.Array, base_Z: jax.Array, hc: int, iters: int, eps: float,
                   iterate=None):
    """Split mixes into ``pre [T, C]``, ``post [T, C]``, ``comb [T, C, C]`` (all fp32). The Sinkhorn
    is ``ops.sinkhorn`` (first step and ``iters - 1`` steps; one kernel on the GPU); ``iterate``,
    when given, runs the steps after a jnp first step instead (tests and probes)."""
    m = m_TZ.astype(jnp.float32)
    s = scale_3.astype(jnp.float32)
    b = base_Z.astype(jnp.float32)
    pre = jax.nn.sigmoid(m[..., :hc] * s[0] + b[:hc]) + eps
    post = 2 * jax.nn.sigmoid(m[..., hc:2 * hc] * s[1] + b[hc:2 * hc])
    comb = (m[..., 2 * hc:] * s[2] + b[2 * hc:]).reshape(*m.shape[:-1], hc, hc)
    comb = jnp.exp(comb - jnp.max(comb, axis=-1, keepdims=True))
    if iterate is None:  # the sums' order and true divisions of kernels_pallas/sinkhorn_ref.py
        return pre, post, ops.sinkhorn(comb, iters, eps)
    return pre, post, sinkhorn_ref.sinkhorn_ref(comb, iters, eps, iterate=iterate)


def _sum_in_order(terms):
    """Left-to-right fp32 sum (the reference adds the hc copies one after another; a tree
    reduction rounds differently, and one bf16 ulp here is amplified by fp8 QDQ downstream)."""
    acc = terms[0]
    for t in terms[1:]:
        acc = acc + t
    return acc


def collapse(x_TCD: jax.Array, pre_TC: jax.Array) -> jax.Array:
    """``sum_c pre_c X_c`` in fp32, returned in the stream's dtype."""
    xf = x_TCD.astype(jnp.float32)
    y = _sum_in_order([pre_TC[..., c, None] * xf[..., c, :] for c in range(x_TCD.shape[-2])])
    return y.astype(x_TCD.dtype)


def expand(out_TD: jax.Array, res_TCD: jax.Array, post_TC: jax.Array, comb_TCC: jax.Array) -> jax.Array:
    """``X'_j = post_j out + sum_i comb[i, j] X_i`` in fp32, returned in ``out``'s dtype."""
    rf = res_TCD.astype(jnp.float32)
    C = res_TCD.shape[-2]
    mixed = _sum_in_order([comb_TCC[..., i, :, None] * rf[..., i, None, :] for i in range(C)])
    y = post_TC[..., None] * out_TD.astype(jnp.float32)[..., None, :] + mixed
    return y.astype(out_TD.dtype)


def hc_params(dim: int, hc: int) -> tuple[nnx.Param, nnx.Param, nnx.Param]:
    """Fresh (fn, base, scale) parameters of one sub-layer's mixes (checkpoint names
    ``hc_{attn,ffn}_{fn,base,scale}`` live on the block)."""
    z = (2 + hc) * hc
    return (nnx.Param(jnp.zeros((z, hc * dim), jnp.float32), logical_axes=(None, None)),
            nnx.Param(jnp.zeros((z,), jnp.float32), logical_axes=(None,)),
            nnx.Param(jnp.ones((3,), jnp.float32), logical_axes=(None,)))


def hc_mixes(x_TCD: jax.Array, fn_ZX: jax.Array, base_Z: jax.Array, scale_3: jax.Array, *,
             hc: int, iters: int, hc_eps: float, norm_eps: float):
    """(pre, post, comb) of a sub-layer from its input stream ``X [T, C, D]``."""
    x = x_TCD.reshape(*x_TCD.shape[:-2], -1).astype(jnp.float32)
    rsqrt = jax.lax.rsqrt(bi.row_mean(jnp.square(x), axis=-1, keepdims=True) + jnp.float32(norm_eps))
    m = bi.matmul(x, fn_ZX.T, precision=HIGHEST) * rsqrt
    return sinkhorn_split(m, scale_3, base_Z, hc, iters, hc_eps)
