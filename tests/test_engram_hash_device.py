"""Device (jnp, 32-bit) last step of the Engram hash vs the numpy oracle ``hash_positions``."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.config import preset
from deepinfer_jax.runner.engram_hash import EngramHasher, is_prime
from deepinfer_jax.runner.engram_hash_device import (
    DeviceEngramTables,
    device_hash,
    device_hash_window,
    host_partials,
    mod_u64,
    mul_u32_u64,
    split_u64,
    window_partials,
)

_INT64_MAX = int(np.iinfo(np.int64).max)
_HASHERS: dict[str, EngramHasher] = {}


def _random_token_map(rng: np.random.Generator, vocab: int, compressed: int) -> np.ndarray:
    tm_V = rng.integers(0, compressed, size=vocab, dtype=np.int64)
    tm_V[rng.integers(0, vocab)] = compressed - 1  # so max + 1 == compressed size
    return tm_V


def _hasher(name: str) -> EngramHasher:
    """v41-tiny / v41-flash Engram constants with a random token map (no tokenizer needed)."""
    if name not in _HASHERS:
        cfg = preset(name)
        tm_V = _random_token_map(
            np.random.default_rng(1234), cfg.vocab_size, cfg.engram_compressed_vocab_size
        )
        _HASHERS[name] = EngramHasher.from_model_config(cfg, token_map=tm_V)
    return _HASHERS[name]


def _oracle_and_device(hasher, tables, rng, lengths, hash_fn=device_hash):
    """One fresh random history per length p; hash position p (its token drawn at random)."""
    vocab = hasher.token_map.shape[0]
    want, partials, toks = [], [], []
    for p in lengths:
        full_N = rng.integers(0, vocab, size=p + 1)
        want.append(hasher.hash_positions(full_N, np.array([p]))[0])
        partials.append(host_partials(hasher, full_N[:p], p))
        toks.append(full_N[p])
    got_TLC = hash_fn(tables, jnp.asarray(np.array(toks), jnp.int32), np.concatenate(partials))
    return np.stack(want), got_TLC


def test_x64_disabled():
    assert not jax.config.jax_enable_x64


@pytest.mark.parametrize("name", ["v41-tiny", "v41-flash"])
def test_tables(name):
    hs = _hasher(name)
    tables = DeviceEngramTables.from_hasher(hs)
    L, G, H = hs.primes.shape
    assert tables.token_map_V.dtype == np.int32 and tables.token_map_V.shape == hs.token_map.shape
    assert tables.mult0_L2.dtype == np.uint32 and tables.mult0_L2.shape == (L, 2)
    assert tables.primes_LGH.dtype == np.uint32 and tables.primes_LGH.shape == (L, G, H)
    assert tables.offsets_LC.dtype == np.int32 and tables.offsets_LC.shape == (L, G * H)
    assert tables.chunk_bits == 32 - int(hs.primes.max()).bit_length()
    if name == "v41-flash":
        assert 2**23 < hs.primes.min() and hs.primes.max() < 2**24 and tables.chunk_bits == 8
        assert hs.token_map.shape == (129280,) and int(hs.token_map.max()) == 99091
    mult0 = [(int(hi) << 32) | int(lo) for hi, lo in tables.mult0_L2]
    assert mult0 == [int(m) for m in hs.multipliers[:, 0]]


@pytest.mark.parametrize("name", ["v41-tiny", "v41-flash"])
def test_matches_oracle_eager(name):
    hs = _hasher(name)
    tables = DeviceEngramTables.from_hasher(hs)
    rng = np.random.default_rng(7)
    for p in [0, 1, 2, 3, 4, 9, 64]:  # p < K-1 reads pad ids for the missing look-backs
        want, got = _oracle_and_device(hs, tables, rng, [p])
        assert got.dtype == jnp.int32 and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"{name} p={p}")


@pytest.mark.parametrize("name", ["v41-tiny", "v41-flash"])
def test_matches_oracle_jit_batch(name):
    hs = _hasher(name)
    tables = jax.device_put(DeviceEngramTables.from_hasher(hs))
    assert isinstance(tables.token_map_V, jax.Array)
    rng = np.random.default_rng(11)
    fn = jax.jit(device_hash)
    for _ in range(3):  # same T: one compile, fresh histories each round
        lengths = [0, 1, 2, 3] + list(rng.integers(0, 200, size=12))
        want, got = _oracle_and_device(hs, tables, rng, lengths, hash_fn=fn)
        assert got.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("name", ["v41-tiny", "v41-flash"])
def test_window_hash_matches_oracle(name):
    """Every token of the n-gram on the device (async speculation): positions from 0 (all
    look-backs are the pad) up to a long history, in one jitted call."""
    hs = _hasher(name)
    tables = jax.device_put(DeviceEngramTables.from_hasher(hs))
    rng = np.random.default_rng(3)
    hist_N = rng.integers(0, hs.token_map.shape[0], size=300)
    pos_T = np.concatenate([np.arange(6), rng.integers(6, 300, size=26)])
    K = hs.max_ngram_size
    src_TK = pos_T[:, None] - np.arange(K)[None, :]
    win_TK = np.where(src_TK >= 0, hist_N[np.maximum(src_TK, 0)], -1)
    got = jax.jit(device_hash_window)(tables, jnp.asarray(win_TK, jnp.int32))
    np.testing.assert_array_equal(np.asarray(got), hs.hash_positions(hist_N, pos_T))
    with pytest.raises(ValueError, match="shifts"):
        device_hash_window(tables, jnp.zeros((2, K + 1), jnp.int32))


def test_host_partials_many_positions_one_history():
    """Array ``position``: every position of one history, incl. p == len(history)."""
    hs = _hasher("v41-flash")
    tables = DeviceEngramTables.from_hasher(hs)
    rng = np.random.default_rng(3)
    full_N = rng.integers(0, hs.token_map.shape[0], size=40)
    hist = full_N[:-1]
    pos_n = np.arange(len(full_N))
    partials = host_partials(hs, hist, pos_n)
    assert partials.dtype == np.uint32 and partials.shape == (40, hs.n_layers, 3, 2)
    got = device_hash(tables, jnp.asarray(full_N, jnp.int32), partials)
    np.testing.assert_array_equal(np.asarray(got), hs.hash_positions(full_N, pos_n))


def test_host_partials_validation():
    hs = _hasher("v41-tiny")
    with pytest.raises(ValueError, match="position must lie"):
        host_partials(hs, np.array([1, 2, 3]), 4)
    with pytest.raises(ValueError, match="token_ids_history must lie"):
        host_partials(hs, np.array([1, 256]), 2)
    assert host_partials(hs, np.array([], dtype=np.int64), 0).shape == (1, hs.n_layers, 3, 2)


def _max_odd_below(bound: int) -> int:
    m = bound - 1
    return m if m % 2 else m - 1


@pytest.mark.parametrize("name", ["v41-tiny", "v41-flash"])
@pytest.mark.parametrize("cmax", ["preset", 2**31 - 1])
def test_edge_max_multiplier_and_id(name, cmax):
    """Largest legal multipliers with the largest compressed id: products reach bit 62."""
    base = _hasher(name)
    rng = np.random.default_rng(5)
    vocab = base.token_map.shape[0]
    if cmax == "preset":
        tm_V = base.token_map
        cmax = int(tm_V.max())
    else:  # general 31-bit compressed ids (fake hasher, not buildable from a config)
        tm_V = _random_token_map(rng, vocab, cmax + 1)
    top = _max_odd_below(_INT64_MAX // (cmax + 1))  # mult < int64_max // compressed size
    mult_LK = top - 2 * rng.integers(0, 50, size=base.multipliers.shape, dtype=np.int64)
    mult_LK[:, 0] = top
    hs = dataclasses.replace(base, token_map=tm_V, multipliers=mult_LK)
    assert cmax * top >= 2**62  # the top bits are exercised
    tables = DeviceEngramTables.from_hasher(hs)
    max_tok = np.flatnonzero(tm_V == cmax)
    fn = jax.jit(device_hash)
    for _ in range(4):
        toks, partials, want = [], [], []
        for p in [0, 1, 2, 3, 5, 17]:
            # mostly max-id tokens, some random ones so the XORs do not cancel
            full_N = np.where(
                rng.random(p + 1) < 0.6,
                rng.choice(max_tok, size=p + 1),
                rng.integers(0, vocab, size=p + 1),
            )
            want.append(hs.hash_positions(full_N, np.array([p]))[0])
            partials.append(host_partials(hs, full_N[:p], p))
            toks.append(full_N[p])
        got = fn(tables, jnp.asarray(np.array(toks), jnp.int32), np.concatenate(partials))
        np.testing.assert_array_equal(np.asarray(got), np.stack(want))


def _primes_near(x: int, n: int, below: bool = True) -> list[int]:
    out, c = [], x
    while len(out) < n:
        c = c - 1 if below else c + 1
        if is_prime(c):
            out.append(c)
    return out


@pytest.mark.parametrize(
    "primes",
    [
        _primes_near(2**24, 6) + _primes_near(2**23, 4, below=False),  # flash-sized, b = 8
        [2, 3, 5, 7, 11, 13, 97, 65521, 65537],  # small, b = 15
        [2, 3, 7, 2**31 - 1, 2147483629],  # near 2**31, b = 1
    ],
)
def test_mod_u64_vs_python(primes):
    rng = np.random.default_rng(17)
    vals = [0, 1, 2**32 - 1, 2**32, 2**62, 2**63 - 1, 2**64 - 1]
    vals += [int(v) for v in rng.integers(0, 2**63, size=300, dtype=np.uint64)]
    vals += [int(v) >> int(s) for v, s in zip(rng.integers(0, 2**64 - 1, size=100,
             dtype=np.uint64, endpoint=True), rng.integers(0, 64, size=100))]
    v_N = np.array(vals, dtype=np.uint64)
    hi_N = (v_N >> np.uint64(32)).astype(np.uint32)
    lo_N = (v_N & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    p_P = np.array(primes, dtype=np.uint32)
    b_max = 32 - max(primes).bit_length()
    want = np.array([[v % p for p in primes] for v in vals], dtype=np.uint64)
    for b in sorted({b_max, 1, max(1, b_max - 3)}):  # any width up to b_max is exact
        got = jax.jit(mod_u64, static_argnums=3)(hi_N[:, None], lo_N[:, None], p_P[None], b)
        assert got.dtype == jnp.uint32
        np.testing.assert_array_equal(np.asarray(got).astype(np.uint64), want, err_msg=f"b={b}")


def test_mul_u32_u64_vs_python():
    rng = np.random.default_rng(19)
    a = [0, 1, 2**31 - 1, 2**32 - 1] + [int(x) for x in rng.integers(0, 2**32, size=200)]
    b = [0, 1, 2**63 - 1, 2**64 - 1] + [
        int(x) for x in rng.integers(0, 2**64 - 1, size=200, dtype=np.uint64, endpoint=True)
    ]
    a_N = np.array(a, dtype=np.uint32)
    b_N = np.array(b, dtype=np.uint64)
    b_hi_N = (b_N >> np.uint64(32)).astype(np.uint32)
    b_lo_N = (b_N & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    hi, lo = mul_u32_u64(a_N, b_hi_N, b_lo_N)
    got = [(int(h) << 32) | int(lo_) for h, lo_ in zip(np.asarray(hi), np.asarray(lo))]
    assert got == [(x * y) % 2**64 for x, y in zip(a, b)]


def test_split_u64():
    v = np.array([0, 1, 2**32, 2**63 - 1, 0x123456789ABCDEF], dtype=np.int64)
    w = split_u64(v)
    assert w.dtype == np.uint32 and w.shape == (5, 2)
    assert [(int(h) << 32) | int(lo) for h, lo in w] == [int(x) for x in v]


def test_from_hasher_rejects_huge_prime():
    hs = _hasher("v41-tiny")
    primes = hs.primes.copy()
    primes[1, 2, 1] = 2**31 + 11  # bit_length 32: no room for a Horner chunk
    with pytest.raises(ValueError, match=r"prime 2147483659 is too large"):
        DeviceEngramTables.from_hasher(dataclasses.replace(hs, primes=primes))


def test_from_hasher_rejects_rows_beyond_int32():
    hs = _hasher("v41-tiny")
    primes = np.full_like(hs.primes, 2**30 + 3)  # fits the mod (b = 1), rows do not fit int32
    offsets = np.zeros_like(hs.offsets)
    offsets[:, 1:] = np.cumsum(primes.reshape(hs.n_layers, -1)[:, :-1], axis=1)
    with pytest.raises(ValueError, match="row ids must fit int32"):
        DeviceEngramTables.from_hasher(dataclasses.replace(hs, primes=primes, offsets=offsets))


def test_from_hasher_rejects_wide_token_map_and_overflow():
    hs = _hasher("v41-tiny")
    tm_V = hs.token_map.copy()
    tm_V[3] = 2**31
    with pytest.raises(ValueError, match=r"token_map entries must lie in \[0, 2\*\*31\)"):
        DeviceEngramTables.from_hasher(dataclasses.replace(hs, token_map=tm_V))
    mult = hs.multipliers.copy()
    mult[0, 1] = _INT64_MAX // 50
    with pytest.raises(ValueError, match="overflows int64"):
        DeviceEngramTables.from_hasher(dataclasses.replace(hs, multipliers=mult))


@pytest.mark.parametrize("name", ["v41-tiny", "v41-flash"])
def test_window_forms_equal_the_per_request_hashes(name):
    """The engine's batched host path (``hash_windows`` / ``window_partials`` over the look-back
    windows of many requests at once) gives exactly the per-request ``hash_positions`` /
    ``host_partials``: fresh random histories, positions near 0 (pad look-backs) and deep."""
    hasher = _hasher(name)
    K = hasher.max_ngram_size
    vocab = hasher.token_map.shape[0]
    rng = np.random.default_rng()
    want_h, want_p, windows = [], [], []
    for n in rng.integers(1, 40, size=24):
        hist = rng.integers(0, vocab, size=int(n))
        pos = rng.integers(0, n, size=int(rng.integers(1, 6)))
        want_h.append(hasher.hash_positions(hist, pos))
        want_p.append(host_partials(hasher, hist, pos))
        src = pos[:, None] - np.arange(K)[None, :]
        windows.append(np.where(src >= 0, hist[np.maximum(src, 0)], -1))
    win = np.concatenate(windows)
    np.testing.assert_array_equal(hasher.hash_windows(win), np.concatenate(want_h))
    np.testing.assert_array_equal(window_partials(hasher, win), np.concatenate(want_p))
    with pytest.raises(ValueError, match=r"window token ids must lie in \[0, "):
        hasher.hash_windows(np.full((1, K), vocab))
    with pytest.raises(ValueError, match=r"window_nK must have shape"):
        hasher.hash_windows(np.zeros((2, K + 1), np.int64))
