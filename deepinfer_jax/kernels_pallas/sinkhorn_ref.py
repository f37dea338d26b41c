"""Pure-jnp reference of the mHC Sinkhorn iterations (``layers/mhc.py``).

``n`` alternating normalisations of ``comb [T, C, C]`` (fp32): rows to sum 1 (``+ eps`` in the
denominator), then columns, ``n`` times, as the reference model does after its first step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_jax.base import batch_invariant as bi


def sinkhorn_step(c: jax.Array, eps: float) -> jax.Array:
    c = c / (bi.row_sum(c, axis=-1, keepdims=True) + eps)
    return c / (bi.row_sum(c, axis=-2, keepdims=True) + eps)


def sinkhorn_iterate_ref(comb_TCC: jax.Array, n: int, eps: float) -> jax.Array:
    """``n`` Sinkhorn steps on fp32 ``comb [..., C, C]`` (a loop, not ``2n`` unrolled ops)."""
    return jax.lax.fori_loop(0, n, lambda _, c: sinkhorn_step(c, eps), comb_TCC.astype(jnp.float32))
