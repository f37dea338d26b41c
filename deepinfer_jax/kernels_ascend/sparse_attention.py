"""``sparse_attention`` through the custom call ``deepinfer_sparse_attention``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.base import kv_codes


def _float(x) -> jax.Array:
    """A pool as the custom call takes it: bf16 / f32 rows. A packed pool (``kv_codes``) is
    decoded whole first: the custom call has no packed form yet."""
    if kv_codes.pool_format(x) != "bf16":
        return kv_codes.unpack(x)
    return x if x.dtype in (jnp.bfloat16, jnp.float32) else x.astype(jnp.float32)


def sparse_attention(q_THA: jax.Array, pools: tuple[jax.Array, ...], idxs: tuple[jax.Array, ...],
                     sink_H: jax.Array, scale: float, exact: bool = True) -> jax.Array:
    """bf16 ``[T, H, A]``; same contract as ``sparse_attention_ref`` (pools read in place)."""
    if len(pools) != len(idxs) or not pools:
        raise ValueError(f"sparse_attention: {len(pools)} pools and {len(idxs)} index arrays")
    call = jax.ffi.ffi_call("deepinfer_sparse_attention", jax.ShapeDtypeStruct(q_THA.shape, jnp.bfloat16),
                            vmap_method="sequential")
    return call(_float(q_THA), sink_H.astype(jnp.float32), *(_float(p) for p in pools),
                *(i.astype(jnp.int32) for i in idxs), n_pools=np.int64(len(pools)), scale=np.float32(scale),
                exact=np.int64(bool(exact)))
