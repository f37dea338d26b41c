"""Linear layer whose weight stays in its checkpoint storage format.

``fmt`` says how the weight is stored and how the product is computed (the reference's rules):

=======  ===================================  =================================================
fmt      stored                               y = x W^T
=======  ===================================  =================================================
fp8      e4m3 [out, in] + ue8m0 32x32 scales   fp8-QDQ(x) (bf16) @ dequant(W) (bf16), fp32 acc -> bf16
fp4      e2m1 x2 [out, in/2] + ue8m0 per 32    same, weight dequantized from fp4
bf16     bf16 [out, in]                        x (bf16) @ W, fp32 acc -> bf16
f32      bf16 [out, in] (as in the file)       fp32(x) @ fp32(W) at full precision -> fp32
=======  ===================================  =================================================

The weight is dequantized inside the jitted computation, so memory holds the quantized bytes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from deepinfer_jax.base import batch_invariant as bi
from deepinfer_jax.base import quant
from deepinfer_jax.kernels_pallas import ops

HIGHEST = jax.lax.Precision.HIGHEST


def matmul_bf16(x: jax.Array, w_T: jax.Array) -> jax.Array:
    """bf16 x bf16 with fp32 accumulation, rounded to bf16. ``w_T`` is [in, out]."""
    return bi.matmul(x.astype(jnp.bfloat16), w_T.astype(jnp.bfloat16),
                     preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def matmul_f32(x: jax.Array, w_T: jax.Array) -> jax.Array:
    """Full-precision fp32 product (no TF32 / bf16 passes on any backend; ``ops.f32_matmul``:
    on the GPU a bf16 weight is read as stored, see ``kernels_pallas/f32_matmul_bf16x3.py``)."""
    return ops.f32_matmul(x, w_T)


def _storage(fmt: str, out_features: int, in_features: int, block: int = 32):
    """(weight shape, weight dtype, scale shape or None) of one stored weight."""
    if fmt == "fp8":
        return (out_features, in_features), jnp.float8_e4m3fn, (-(-out_features // block), -(-in_features // block))
    if fmt == "fp4":
        return (out_features, in_features // 2), jnp.uint8, (out_features, in_features // block)
    if fmt in ("bf16", "f32"):
        return (out_features, in_features), jnp.bfloat16, None
    raise ValueError(f"unknown weight format {fmt!r}")


class Linear(nnx.Module):
    """``y = x W^T`` with W in one of the storage formats of the module docstring."""

    def __init__(self, in_features: int, out_features: int, fmt: str, *, axes=(None, None)):
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        wshape, wdtype, sshape = _storage(fmt, out_features, in_features)
        self.weight = nnx.Param(jnp.zeros(wshape, wdtype), logical_axes=tuple(axes))
        if sshape is not None:
            self.scale = nnx.Param(jnp.full(sshape, 127, jnp.uint8), logical_axes=tuple(axes))

    def dequantized(self, dtype=jnp.bfloat16) -> jax.Array:
        """The weight as ``dtype [out, in]`` (exact for bf16/fp32 targets)."""
        w = self.weight[...]
        if self.fmt == "fp8":
            return quant.dequant_fp8_block(w, self.scale[...], dtype=dtype)
        if self.fmt == "fp4":
            return quant.dequant_fp4(w, self.scale[...], dtype=dtype)
        return w.astype(dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.fmt in ("fp8", "fp4"):
            return matmul_bf16(quant.act_quant_fp8(x.astype(jnp.bfloat16)), self.dequantized().T)
        if self.fmt == "bf16":
            return matmul_bf16(x, self.weight[...].T)
        return matmul_f32(x, self.weight[...].T)


def dense_fmt(weight_dtype: str) -> str:
    """Format of the dense Linear weights that follow ``quantization_config``."""
    return "fp8" if weight_dtype == "fp8" else "bf16"


def expert_fmt(expert_dtype: str) -> str:
    return {"fp4": "fp4", "fp8": "fp8", "bf16": "bf16"}[expert_dtype]

