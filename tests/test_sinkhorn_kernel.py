"""mHC Sinkhorn kernel (``kernels_pallas/sinkhorn.py``) vs its jnp reference.

CPU: interpret mode and the Triton lowering for an H200; ``-m device``: compiled on the GPU.
Tolerance: a few fp32 ulps (the kernel may add a row's 4 entries in another order; 19 steps of
normalisation keep such differences at that level)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import KERNEL_MODES
from deepinfer_jax.kernels_pallas import ops, sinkhorn, sinkhorn_ref


MODES = KERNEL_MODES


def _comb(T, C, seed):
    """Positive matrices as ``sinkhorn_split`` produces them (softmax rows + eps, column-normalised),
    with logits spread wide enough that the iterations still move the values."""
    z = np.random.default_rng(seed).standard_normal((T, C, C)).astype(np.float32) * 3
    c = np.exp(z - z.max(-1, keepdims=True))
    c = c / c.sum(-1, keepdims=True) + 1e-6
    return jnp.asarray(c / (c.sum(-2, keepdims=True) + 1e-6), jnp.float32)


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("T,C,n", [(1, 4, 19), (3, 4, 19), (64, 4, 19), (300, 4, 19), (37, 2, 5), (16, 8, 19),
                                   (5, 4, 1)])
def test_matches_reference(interpret, T, C, n):
    comb = _comb(T, C, [T, C, n])
    got = np.asarray(sinkhorn.sinkhorn_iterate(comb, n, 1e-6, interpret=interpret))
    want = np.asarray(sinkhorn_ref.sinkhorn_iterate_ref(comb, n, 1e-6))
    assert got.shape == (T, C, C) and np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=4e-6, atol=1e-9)
    assert not np.allclose(want, np.asarray(comb), rtol=1e-3)  # the iterations did change the input
    np.testing.assert_allclose(got.sum(-2), 1.0, rtol=1e-5)  # columns normalised last


def test_zero_steps_and_empty_batch():
    comb = _comb(4, 4, 0)
    np.testing.assert_array_equal(np.asarray(sinkhorn.sinkhorn_iterate(comb, 0, 1e-6, interpret=True)), comb)
    assert sinkhorn.sinkhorn_iterate(jnp.zeros((0, 4, 4)), 19, 1e-6, interpret=True).shape == (0, 4, 4)
    with pytest.raises(ValueError, match="power of two"):
        sinkhorn.sinkhorn_iterate(jnp.ones((2, 3, 3)), 19, 1e-6, interpret=True)


@pytest.mark.parametrize("T", [64, 4096, 300])
def test_lowers_to_triton_sm90(sm90_lowering, T):
    """Pallas -> Triton IR for an H200 on the CPU: one custom call, no while loop left in the step."""
    text = sinkhorn.sinkhorn_iterate.trace(jax.ShapeDtypeStruct((T, 4, 4), jnp.float32), 19, 1e-6).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert "stablehlo.while" not in text


def test_not_loaded_by_default():
    """The model's op (``ops.sinkhorn_iterate``) keeps the reference loop on the GPU: the module is
    not among the GPU's default kernel modules and importing it registers nothing (the golden tests
    on the GPU do not all pass with it; see its docstring); ``register()`` turns it on."""
    import importlib

    assert "deepinfer_jax.kernels_pallas.sinkhorn" not in ops._KERNEL_MODULES["gpu"]
    importlib.import_module("deepinfer_jax.kernels_pallas.sinkhorn")
    assert ("sinkhorn_iterate", "gpu") not in ops._KERNELS
