"""``sinkhorn_iterate`` through the custom call ``deepinfer_sinkhorn_iterate``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def sinkhorn_iterate(comb_TCC: jax.Array, n: int, eps: float) -> jax.Array:
    """``n`` Sinkhorn steps on fp32 ``comb [..., C, C]`` (kernels_pallas/sinkhorn_ref.py)."""
    c = comb_TCC.astype(jnp.float32)
    call = jax.ffi.ffi_call("deepinfer_sinkhorn_iterate", jax.ShapeDtypeStruct(c.shape, jnp.float32),
                            vmap_method="broadcast_all")  # leading dims are batch dims to the kernel
    return call(c, n=np.int64(n), eps=np.float32(eps))
