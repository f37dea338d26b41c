"""The fp32 product of the fp32 layers (LM head, DSpark head, routers): the GPU's three-part bf16
split (``kernels_pallas/f32_matmul_bf16x3.py``) against its reference and an fp64 product.

Runs on whatever backend JAX has (CPU here; the device check runs it on the GPU too, where the
GEMM is cuBLAS's). Tolerances: both products add ``K`` fp32 products in fp32, so their error
against an fp64 product is a few fp32 ulps of ``sum |x w|``; the split's bound is twice the reference's
own error on the same inputs (max and mean), which a split that dropped its third part (16 of
the 24 bits kept) exceeds: its mean error is 6-17x the reference's on these inputs.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.base import batch_invariant as bi
from deepinfer_jax.kernels_pallas import f32_matmul_bf16x3 as S
from deepinfer_jax.kernels_pallas import f32_matmul_ref as R
from deepinfer_jax.kernels_pallas import ops


def _inputs(T, K, N, seed):
    rng = np.random.default_rng(seed)
    # activations over several binades (as a final RMSNorm output times its weight), never zero
    x = (rng.standard_normal((T, K)) * np.exp2(rng.integers(-6, 7, (T, K)))).astype(np.float32)
    w = jnp.asarray(rng.standard_normal((K, N)) * K ** -0.5, jnp.bfloat16)
    return jnp.asarray(x), w


def _scaled_err(y, x, w):
    """|y - x @ w (fp64)| / (|x| @ |w|) per entry: the error relative to the dot product's scale."""
    x64, w64 = np.asarray(x, np.float64), np.asarray(w.astype(jnp.float32), np.float64)
    return np.abs(np.asarray(y, np.float64) - x64 @ w64) / (np.abs(x64) @ np.abs(w64))


def test_split_parts_sum_to_the_input_exactly():
    x, _ = _inputs(64, 300, 1, 0)
    parts = S.split3(x)
    assert parts.dtype == jnp.bfloat16 and parts.shape == (3, 64, 300)
    p = np.asarray(parts.astype(jnp.float32))
    np.testing.assert_array_equal(p[0] + (p[1] + p[2]), np.asarray(x))  # every fp32 bit is kept
    assert np.count_nonzero(p[2]) > 0.9 * p[2].size  # the third part carries bits (not a no-op)


@pytest.mark.parametrize("T,K,N", [(1, 64, 96), (7, 256, 1000), (33, 1024, 513), (128, 2048, 256)])
def test_matches_the_fp32_product(T, K, N):
    x, w = _inputs(T, K, N, [T, K, N])
    got = S.f32_matmul_bf16x3(x, w)
    ref = R.f32_matmul_ref(x, w)
    assert got.dtype == jnp.float32 and got.shape == (T, N)
    e_got, e_ref = _scaled_err(got, x, w), _scaled_err(ref, x, w)
    assert e_got.max() <= 2 * e_ref.max(), (e_got.max(), e_ref.max())
    assert e_got.mean() <= 2 * e_ref.mean(), (e_got.mean(), e_ref.mean())
    # what dropping the third part would cost (16 of the 24 bits): the bound above excludes it
    two = np.asarray(S.split3(x)[:2].astype(jnp.float32).sum(0))
    e_two = _scaled_err(two @ np.asarray(w.astype(jnp.float32), np.float64), x, w)
    assert e_two.mean() > 4 * e_ref.mean()


def test_leading_dims_and_non_bf16_weights():
    """The op flattens leading dims; an fp32 weight (no exact bf16 parts) takes the reference."""
    x, w = _inputs(12, 128, 40, 3)
    x3 = x.reshape(3, 4, 128)
    got = S.f32_matmul_op(x3, w)
    assert got.shape == (3, 4, 40)
    np.testing.assert_array_equal(np.asarray(got).reshape(12, 40), np.asarray(S.f32_matmul_bf16x3(x, w)))
    w32 = w.astype(jnp.float32) * 1.001
    np.testing.assert_array_equal(np.asarray(S.f32_matmul_op(x, w32)), np.asarray(R.f32_matmul_ref(x, w32)))
    with pytest.raises(ValueError, match="must be bf16"):
        S.f32_matmul_bf16x3(x, w32)


def test_batch_invariant_rows_do_not_depend_on_the_batch():
    """In batch-invariant mode a row's product is the same at 5 rows and at 70 (other rows random)."""
    x, w = _inputs(70, 256, 300, 4)
    with bi.use(True):
        small = jax.jit(S.f32_matmul_bf16x3)(x[:5], w)
        big = jax.jit(S.f32_matmul_bf16x3)(x, w)
    np.testing.assert_array_equal(np.asarray(small), np.asarray(big)[:5])


def test_registered_for_the_gpu_only():
    """Loading the GPU's kernel modules registers the split as the GPU's ``f32_matmul``; other
    platforms keep the reference."""
    assert "deepinfer_jax.kernels_pallas.f32_matmul_bf16x3" in ops._KERNEL_MODULES["gpu"]
    importlib.import_module("deepinfer_jax.kernels_pallas.f32_matmul_bf16x3")
    assert ops._KERNELS[("f32_matmul", "gpu")] is S.f32_matmul_op
    assert ("f32_matmul", "cpu") not in ops._KERNELS
    with ops.use_backend("auto"):
        picked = ops._pick("f32_matmul", R.f32_matmul_ref)
    assert picked is (S.f32_matmul_op if jax.default_backend() == "gpu" else R.f32_matmul_ref)
