"""Pure-jnp reference of the full-precision product behind the fp32 layers (the LM head, the
DSpark head and gate, the MoE router): ``fp32(x) @ fp32(W)`` at ``Precision.HIGHEST``.

The weights of these layers are stored in bf16 (``layers/linear.py``, fmt ``f32``), so their
conversion to fp32 is exact and the product is the reference model's fp32 product.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_jax.base import batch_invariant as bi


def f32_matmul_ref(x_TK: jax.Array, w_KN: jax.Array) -> jax.Array:
    """``x [T, K] @ w [K, N]`` in fp32 at full precision (no TF32 / bf16 passes on any backend)."""
    return bi.matmul(x_TK.astype(jnp.float32), w_KN.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
