"""The fp32 product against a bf16 weight as one bf16 GEMM of three times the rows (GPU).

Why: the reference (``f32_matmul_ref``) converts the bf16 weight to fp32 and runs an fp32
GEMM. On a GPU that materialises an fp32 copy of the weight in HBM every step (the LM head's
129280 x 5120 weight: 2.6 GB written and read again) and then runs at fp32 CUDA-core rate.

Here the fp32 input is split exactly into three bf16 parts, ``x = x1 + x2 + x3`` (bf16 keeps 8
significant bits, fp32 24: three parts carry all of them, barring parts below bf16's smallest
normal), the parts are stacked as ``3T`` rows and multiplied against the bf16 weight as it is
stored, with fp32 accumulation, and the three partial products are summed. Every product
``x_i * w`` of two bf16 values is exact in fp32, so the result differs from the fp32 GEMM only
in the order of the fp32 adds (same error class; ``tests/test_f32_matmul.py`` bounds both against
an fp64 product). The weight is read once, in its stored bytes.

The split uses ``lax.reduce_precision``, which XLA does not fold away (a convert pair
``f32 -> bf16 -> f32`` is folded where excess precision is allowed).

At many rows the GEMM becomes FLOP-bound (3x the FLOPs of one bf16 GEMM), still far above the
fp32 path; the model only multiplies the rows it samples (``logits_indices``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from deepinfer_jax.base import batch_invariant as bi
from deepinfer_jax.kernels_pallas import f32_matmul_ref


def _bf16_part(x: jax.Array) -> jax.Array:
    """``x`` (fp32) rounded to the nearest bf16 value, still fp32."""
    return lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7)


def split3(x_TK: jax.Array) -> jax.Array:
    """``[3, T, K]`` bf16 parts whose fp32 sum is ``x`` (to the last bit for normal values)."""
    x = x_TK.astype(jnp.float32)
    p1 = _bf16_part(x)
    r = x - p1
    p2 = _bf16_part(r)
    p3 = _bf16_part(r - p2)
    return jnp.stack([p1, p2, p3]).astype(jnp.bfloat16)


def _product(x_TK: jax.Array, w_KN: jax.Array) -> jax.Array:
    T, K = x_TK.shape
    y = jnp.matmul(split3(x_TK).reshape(3 * T, K), w_KN, preferred_element_type=jnp.float32)
    y = y.reshape(3, T, -1)
    return y[0] + (y[1] + y[2])  # the small parts first


def f32_matmul_bf16x3(x_TK: jax.Array, w_KN: jax.Array) -> jax.Array:
    """Twin of ``f32_matmul_ref`` for a bf16 ``w_KN`` (see the module docstring)."""
    if w_KN.dtype != jnp.bfloat16:
        raise ValueError(f"f32_matmul_bf16x3: the weight must be bf16, got {w_KN.dtype}")
    return bi.rowwise(_product, x_TK, consts=(w_KN,))


def f32_matmul_op(x_TK: jax.Array, w_KN: jax.Array) -> jax.Array:
    """What ``ops.f32_matmul`` runs on the GPU: the split product for bf16 weights, the reference
    for any other weight dtype (an fp32 weight has no exact three-part bf16 form)."""
    if w_KN.dtype != jnp.bfloat16:
        return f32_matmul_ref.f32_matmul_ref(x_TK, w_KN)
    lead, K = x_TK.shape[:-1], x_TK.shape[-1]
    return f32_matmul_bf16x3(x_TK.reshape(-1, K), w_KN).reshape(*lead, w_KN.shape[-1])


def register() -> None:
    from deepinfer_jax.kernels_pallas import ops

    ops.register_kernel("f32_matmul", "gpu", f32_matmul_op)


register()
