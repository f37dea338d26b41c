"""The index-key cache format (``quant.pack_index_keys``): e5m2 codes + one power-of-two scale
per key hold the fp4-QDQ'd keys exactly, half the bytes of bf16."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.base import quant


def _fp4_keys(rng, shape, block_binades: int, row_binades: int):
    """fp4-QDQ'd keys (as the indexer writes them) whose 32-blocks differ by up to
    ``block_binades`` and whose rows differ by up to ``row_binades`` in magnitude."""
    *lead, J = shape
    x = rng.standard_normal((*lead, J // 32, 32)) * np.exp2(rng.integers(0, block_binades + 1, (*lead, J // 32, 1)))
    x = x.reshape(shape) * np.exp2(rng.integers(-row_binades, row_binades + 1, (*lead, 1)))
    return quant.act_quant_fp4(jnp.asarray(x, jnp.bfloat16), 32, "ue8m0")


@pytest.mark.parametrize("shape", [(64, 128), (3, 5, 64)])
def test_round_trip_is_exact(shape):
    k = _fp4_keys(np.random.default_rng(list(shape)), shape, block_binades=24, row_binades=60)
    codes, scale = quant.pack_index_keys(k)
    assert codes.dtype == jnp.float8_e5m2 and codes.shape == k.shape
    assert scale.dtype == jnp.float32 and scale.shape == k.shape[:-1]
    s = np.asarray(scale)
    np.testing.assert_array_equal(s, np.exp2(np.round(np.log2(s))))  # powers of two
    back = quant.unpack_index_keys(codes, scale)
    assert back.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(back, np.float32), np.asarray(k, np.float32))
    # the row's largest code sits in [2^14, 2^15): the top of e5m2's range, nothing saturates
    amax = np.abs(np.asarray(codes, np.float32)).max(-1)
    assert ((amax >= 2.0 ** 14) & (amax < 2.0 ** 15)).all()


def test_zero_rows_and_mixed_signs():
    k = jnp.asarray([[0.0] * 32, [-6.0, 0.5] + [0.0] * 30, [2.0 ** -100, -(2.0 ** -100)] + [0.0] * 30],
                    jnp.bfloat16)
    codes, scale = quant.pack_index_keys(k)
    assert float(scale[0]) == 1.0
    np.testing.assert_array_equal(np.asarray(quant.unpack_index_keys(codes, scale), np.float32),
                                  np.asarray(k, np.float32))


def test_entries_beyond_the_range_flush_towards_zero():
    """The documented limit: an entry below amax * 2^-29 is not representable next to the row's
    amax; it rounds on e5m2's subnormal grid (here to zero) and nothing else in the row moves."""
    k = jnp.asarray([[4.0, 2.0 ** -30, 1.0] + [0.0] * 29], jnp.bfloat16)
    back = np.asarray(quant.unpack_index_keys(*quant.pack_index_keys(k)), np.float32)
    assert back[0, 1] == 0.0
    np.testing.assert_array_equal(back[0, [0, 2]], [4.0, 1.0])
