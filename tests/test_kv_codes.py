"""``base/kv_codes.py``: packed window / compressed KV entries decode to exactly the values the
bf16 caches hold (the model's own fp8 / fp4 rounding), at a fraction of the bytes."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.base import kv_codes, quant
from deepinfer_jax.config import preset
from deepinfer_jax.models.cache import CacheConfig, allocate_cache, comp_entries, window_entries


def _bits(x) -> np.ndarray:
    return np.asarray(x).view(np.uint16)


def _rows(seed: int, n: int, A: int) -> jax.Array:
    """Random rows whose magnitudes span 2^-20 .. 2^20 from row to row, with exact zeros, -0.0,
    a whole zero row and ties of the rounding grids mixed in."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, A)) * 2.0 ** rng.integers(-20, 21, (n, 1))
    x[0] = 0.0
    x[1, : A // 2] = -0.0
    x[2, :8] = [0.75, 1.75, 3.5, -0.25, 2.5, -5.0, 448.0, -448.0]  # e2m1 / e4m3 midpoints and the max
    return jnp.asarray(x, jnp.bfloat16)


@pytest.mark.parametrize("seed,n,A", [(0, 9, 64), (1, 33, 512), (2, 4, 32)])
def test_window_codes_decode_to_the_fp8_qdq(seed, n, A):
    x = _rows(seed, n, A)
    pool = kv_codes.pack_window(x)
    assert pool.fmt == "fp8" and pool.width == A
    assert pool.codes.shape == (n, A) and pool.scales.shape == (n, A // 32)
    np.testing.assert_array_equal(_bits(kv_codes.unpack(pool)), _bits(quant.act_quant_fp8(x)))


@pytest.mark.parametrize("seed,n,A", [(3, 9, 64), (4, 33, 512), (5, 4, 16)])
def test_comp_codes_decode_to_the_fp4_qdq(seed, n, A):
    x = _rows(seed, n, A)
    pool = kv_codes.pack_comp(x)
    assert pool.fmt == "fp4" and pool.width == A
    assert pool.codes.shape == (n, A // 2) and pool.scales.shape == (n, A // 16)
    np.testing.assert_array_equal(_bits(kv_codes.unpack(pool)), _bits(quant.act_quant_fp4(x, 16, "e4m3")))


def test_nibble_order_and_signed_zero():
    """Even channel in the low nibble; -0.0 keeps its sign through the round trip."""
    x = jnp.asarray([[1.0, -6.0] + [0.0] * 14, [-0.0] * 16], jnp.bfloat16)
    pool = kv_codes.pack_comp(x)
    assert int(pool.codes[0, 0]) & 0x0F == int(quant.e2m1_code(jnp.float32(1.0)))
    assert int(pool.codes[0, 0]) >> 4 == int(quant.e2m1_code(jnp.float32(-6.0)))
    out = np.asarray(kv_codes.unpack(pool), np.float32)
    assert out[0, 0] == 1.0 and out[0, 1] == -6.0
    assert np.all(np.signbit(out[1]))


def test_take_rows_decodes_only_what_it_takes():
    x = _rows(6, 20, 64)
    idx = jnp.asarray([[3, 3, 19], [0, 7, 2]])
    for pool in (kv_codes.pack_window(x), kv_codes.pack_comp(x)):
        np.testing.assert_array_equal(_bits(kv_codes.take_rows(pool, idx)), _bits(kv_codes.unpack(pool)[idx]))
    np.testing.assert_array_equal(_bits(kv_codes.take_rows(x, idx)), _bits(x[idx]))


def test_packed_cache_layout_and_bytes():
    """``kv_cache_dtype="packed"``: the layout of the module doc, 52% / 28% of the bf16 bytes at
    A = 512 (V4.1's head_dim), and all-zero caches that decode to zeros."""
    cfg = dataclasses.replace(preset("v41-tiny"), head_dim=512)
    cc = CacheConfig(num_slots=2, num_blocks=4, block_tokens=64, max_blocks_per_seq=2)
    plain = allocate_cache(cfg, cc)
    packed = allocate_cache(cfg, dataclasses.replace(cc, kv_cache_dtype="packed"))
    assert not plain.packed and packed.packed
    assert plain.window_scale == () and plain.comp_kv_scale == ()

    def nbytes(arrays):
        return sum(a.size * a.dtype.itemsize for a in arrays)

    assert nbytes(packed.window + packed.window_scale) / nbytes(plain.window) == pytest.approx((512 + 16) / 1024)
    assert nbytes(packed.comp_kv + packed.comp_kv_scale) / nbytes(plain.comp_kv) == pytest.approx((256 + 32) / 1024)
    for i in range(len(packed.window)):
        assert not np.any(np.asarray(window_entries(packed, i), np.float32))
    for i in range(len(packed.comp_kv)):
        assert not np.any(np.asarray(comp_entries(packed, i), np.float32))


def test_bad_formats_are_named():
    cfg = preset("v41-tiny")
    with pytest.raises(ValueError, match=r"CacheConfig.kv_cache_dtype='fp4': expected one of \('bf16', 'packed'\)"):
        CacheConfig(kv_cache_dtype="fp4").validate(cfg)
    odd = dataclasses.replace(cfg, head_dim=48)
    with pytest.raises(ValueError, match="head_dim 48 is not a multiple of 32"):
        CacheConfig(kv_cache_dtype="packed").validate(odd)
    with pytest.raises(ValueError, match="no packed KV format"):
        kv_codes.pool_format(kv_codes.PackedPool(jnp.zeros((2, 8), jnp.bfloat16), jnp.zeros((2, 1), jnp.uint8)))
