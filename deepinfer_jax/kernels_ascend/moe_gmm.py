"""``moe_experts`` through the custom call ``deepinfer_moe_experts``: weights passed in their
storage format (bf16; fp8 e4m3 + ue8m0 32x32 scales; fp4 e2m1 two a byte + ue8m0 per 32)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

FMT_CODES = {"fp8": 1, "fp4": 2}  # anything else: bf16 weights (code 0)


def _bytes(a: jax.Array) -> jax.Array:
    """A one-byte array (codes, packed nibbles, ue8m0 scales) as raw uint8."""
    if a.dtype == jnp.uint8:
        return a
    if a.dtype.itemsize != 1:
        raise ValueError(f"moe_experts: expected one-byte storage, got {a.dtype}")
    return jax.lax.bitcast_convert_type(a, jnp.uint8)


def _parts(w, code: int):
    values, scale = w
    if code == 0:
        return values.astype(jnp.bfloat16), jnp.zeros((1,), jnp.uint8)
    if scale is None:
        raise ValueError("moe_experts: quantized experts need their scales")
    return (values if code == 1 else _bytes(values)), _bytes(scale)


def moe_experts(x_TD, idx_TX, weight_TX, w1, w2, w3, fmt: str, swiglu_limit: float, n_experts: int) -> jax.Array:
    """bf16 ``[T, X, D]`` (``moe_experts_ref``)."""
    code = FMT_CODES.get(fmt, 0)
    T, X = idx_TX.shape
    D = x_TD.shape[-1]
    if code == 1 and w1[0].dtype != jnp.float8_e4m3fn:
        raise ValueError(f"moe_experts: fp8 experts are float8_e4m3fn, got {w1[0].dtype}")
    call = jax.ffi.ffi_call("deepinfer_moe_experts", jax.ShapeDtypeStruct((T, X, D), jnp.bfloat16),
                            vmap_method="sequential")
    return call(x_TD.astype(jnp.bfloat16), idx_TX.astype(jnp.int32), weight_TX.astype(jnp.float32),
                *_parts(w1, code), *_parts(w2, code), *_parts(w3, code), fmt=np.int64(code),
                limit=np.float32(swiglu_limit), n_experts=np.int64(n_experts))
