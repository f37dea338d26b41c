"""mHC Sinkhorn kernel (``kernels_pallas/sinkhorn.py``) vs its jnp reference.

CPU: interpret mode and the Triton lowering for an H200; ``-m device``: compiled on the GPU.
Tolerance: none. The kernel adds each row's and column's entries left to right and divides with
IEEE division, as the numpy oracle ``sinkhorn_ref.sinkhorn_iterate_np`` does, so their bits agree.
(The jnp reference agrees with the oracle on the CPU; XLA's GPU code for it does not, by up to
~20 fp32 ulps after 19 steps on an H200, so the GPU's kernel is checked against the oracle.)"""

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
    want = sinkhorn_ref.sinkhorn_iterate_np(comb, n, 1e-6)
    assert got.shape == (T, C, C) and np.isfinite(got).all()
    np.testing.assert_array_equal(got, want)
    assert not np.allclose(want, np.asarray(comb), rtol=1e-3)  # the iterations did change the input
    np.testing.assert_allclose(got.sum(-2), 1.0, rtol=1e-5)  # columns normalised last


def _numerators(T, C, seed):
    """Softmax numerators as ``sinkhorn_split`` hands them to ``ops.sinkhorn``: ``exp(z - max z)``
    per row, in (0, 1] with a 1 in each row."""
    z = np.random.default_rng(seed).standard_normal((T, C, C)).astype(np.float32) * 3
    return jnp.asarray(np.exp(z - z.max(-1, keepdims=True)), jnp.float32)


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("T,C,iters", [(1, 4, 20), (64, 4, 20), (300, 4, 20), (37, 2, 6), (16, 8, 20), (5, 4, 1)])
def test_first_step_in_the_kernel_matches_the_oracle(interpret, T, C, iters):
    """The whole Sinkhorn of ``sinkhorn_split`` in one launch (``first_step=True``) computes the
    bits of the numpy oracle. On the CPU these are also the bits of the jnp first step followed by
    the steps' kernel; on the GPU XLA's code for that first step is off by an ulp or so (an H100
    measured up to 1.8e-7 after 19 steps), which the fused kernel removes."""
    c = _numerators(T, C, [T, C, iters, 1])
    got = np.asarray(sinkhorn.sinkhorn_iterate(c, iters - 1, 1e-6, first_step=True, interpret=interpret))
    want = sinkhorn_ref.sinkhorn_np(c, iters, 1e-6)
    np.testing.assert_array_equal(got, want)
    if interpret:
        two_launches = sinkhorn.sinkhorn_iterate(sinkhorn_ref.first_step_ref(c, 1e-6), iters - 1, 1e-6, interpret=True)
        np.testing.assert_array_equal(got, np.asarray(two_launches))
    np.testing.assert_allclose(got.sum(-2), 1.0, rtol=1e-4)  # columns normalised last (to 1 - eps / sum)
    assert not np.allclose(got, sinkhorn_ref.first_step_np(c, 1e-6), rtol=1e-3) or iters == 1


def _wide_numerators(T, C, seed):
    """Softmax numerators of logits spread so wide that some underflow: subnormal entries and
    exact zeros beside the 1 of each row (what the first step's ``+ eps`` must absorb)."""
    z = np.random.default_rng(seed).standard_normal((T, C, C)).astype(np.float32) * 40
    c = np.exp(z - z.max(-1, keepdims=True))
    assert (c == 0).any() and ((c > 0) & (c < np.finfo(np.float32).tiny)).any()
    return jnp.asarray(c, jnp.float32)


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("division", ["fma", "rn"])
def test_both_divisions_give_the_oracle_bits(interpret, division):
    """PTX ``div.rn.f32`` and the kernel's branch-free division (``"fma"``, the default) give the
    oracle's bits, also on entries that underflow (compiled: the GPU's instructions; interpreted,
    both are XLA's division)."""
    for c in (_numerators(300, 4, 5), _wide_numerators(300, 4, 6)):
        got = np.asarray(sinkhorn.sinkhorn_iterate(c, 19, 1e-6, first_step=True, interpret=interpret,
                                                   division=division))
        np.testing.assert_array_equal(got, sinkhorn_ref.sinkhorn_np(c, 20, 1e-6))


def test_unknown_division_is_named():
    with pytest.raises(ValueError, match="division 'approx'"):
        sinkhorn.sinkhorn_iterate(_numerators(4, 4, 0), 19, 1e-6, interpret=True, division="approx")


def test_split_reference_is_the_oracle():
    """``sinkhorn_split`` through ``ops.sinkhorn``'s reference (jnp first step, then the steps),
    compiled for the CPU, gives the oracle's bits."""
    from deepinfer_jax.layers import mhc

    rng = np.random.default_rng(11)
    m = jnp.asarray(rng.standard_normal((7, 24)) * 2, jnp.float32)
    scale = jnp.asarray([0.7, 1.3, 1.0], jnp.float32)
    base = jnp.zeros((24,), jnp.float32)
    with ops.use_backend("reference"):
        _, _, comb = jax.jit(lambda m: mhc.sinkhorn_split(m, scale, base, 4, 20, 1e-6))(m)
    z = m[:, 8:].reshape(7, 4, 4)
    numerators = np.asarray(jnp.exp(z - jnp.max(z, -1, keepdims=True)))
    np.testing.assert_array_equal(np.asarray(comb), sinkhorn_ref.sinkhorn_np(numerators, 20, 1e-6))


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


def test_loaded_by_default_on_the_gpu():
    """The model's op (``ops.sinkhorn_iterate``) runs the kernel on the GPU: the module is one of
    the GPU's default kernel modules and registers the op when imported."""
    import importlib

    assert "deepinfer_jax.kernels_pallas.sinkhorn" in ops._KERNEL_MODULES["gpu"]
    importlib.import_module("deepinfer_jax.kernels_pallas.sinkhorn")
    assert ops._KERNELS[("sinkhorn_iterate", "gpu")] is sinkhorn.sinkhorn_iterate_op
    assert ops._KERNELS[("sinkhorn", "gpu")] is sinkhorn.sinkhorn_op  # mhc.sinkhorn_split's op


def test_fused_kernel_lowers_to_one_triton_call(sm90_lowering):
    """The first step and the 19 steps lower to one Triton custom call for an H200."""
    text = sinkhorn.sinkhorn_iterate.trace(jax.ShapeDtypeStruct((64, 4, 4), jnp.float32), 19, 1e-6,
                                           first_step=True).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert "stablehlo.while" not in text


def test_split_divides_and_sums_as_the_reference_model():
    """``mhc.sinkhorn_split`` (first step + iterations) equals a numpy evaluation with true
    divisions and left-to-right sums, bit for bit; XLA's rewrite of ``c / broadcast(s)`` into a
    reciprocal times ``c`` (other bits) must not reach it."""
    from deepinfer_jax.layers import mhc

    rng = np.random.default_rng(7)
    m = jnp.asarray(rng.standard_normal((9, 24)) * 2, jnp.float32)
    scale = jnp.asarray([0.7, 1.3, 1.0], jnp.float32)  # comb logits = m exactly (no rounding to match)
    base = jnp.zeros((24,), jnp.float32)
    first = []
    mhc.sinkhorn_split(m, scale, base, 4, 20, 1e-6, iterate=lambda c, n, eps: first.append(c) or c)
    _, _, comb = mhc.sinkhorn_split(m, scale, base, 4, 20, 1e-6, iterate=sinkhorn_ref.sinkhorn_iterate_ref)
    z = m[:, 8:].reshape(9, 4, 4)
    c = np.asarray(jnp.exp(z - jnp.max(z, -1, keepdims=True)))
    eps = np.float32(1e-6)

    def rows(c):
        return ((c[..., 0:1] + c[..., 1:2]) + c[..., 2:3]) + c[..., 3:4]

    def cols(c):
        return ((c[..., 0:1, :] + c[..., 1:2, :]) + c[..., 2:3, :]) + c[..., 3:4, :]

    c = c / rows(c) + eps
    c = c / (cols(c) + eps)
    np.testing.assert_array_equal(np.asarray(first[0]), c)
    np.testing.assert_array_equal(np.asarray(comb), sinkhorn_ref.sinkhorn_iterate_np(c, 19, 1e-6))


def test_reference_on_the_cpu_is_the_oracle():
    """The jnp reference, compiled by XLA for the CPU, computes the numpy oracle's bits."""
    comb = np.asarray(_comb(257, 4, 3))
    with jax.default_device(jax.devices("cpu")[0]):
        got = np.asarray(jax.jit(sinkhorn_ref.sinkhorn_iterate_ref, static_argnums=(1, 2))(jnp.asarray(comb), 19, 1e-6))
    np.testing.assert_array_equal(got, sinkhorn_ref.sinkhorn_iterate_np(comb, 19, 1e-6))
