"""RMSNorm as the reference computes it: fp32 statistics, ``weight * x`` in fp32, then the
input dtype. V4.1 uses eps = 1e-20 everywhere."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from deepinfer_jax.base import batch_invariant as bi


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    var = bi.row_mean(jnp.square(xf), axis=-1, keepdims=True)
    y = xf * jax.lax.rsqrt(var + jnp.float32(eps))
    return (weight.astype(jnp.float32) * y).astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, axes=(None,)):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), jnp.bfloat16), logical_axes=tuple(axes))

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)
