"""Engram n-gram hashing vs the DeepSeek-V4.1 reference goldens (host side, numpy only)."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest

from deepinfer_jax.runner.engram_hash import (
    EngramHasher,
    compressed_token_map,
    identity_token_map,
    is_prime,
)

from conftest import golden_root

GOLDEN_ROOT = golden_root()
CONFIGS = ["tiny_fp8", "tiny_bf16", "tiny_fp8_long", "tiny_fp8_long_allsel"]
ENGRAM_FIELDS = (
    "engram_layer_ids",
    "engram_num_embeddings",
    "engram_max_ngram_size",
    "engram_vocab_size",
    "engram_n_heads",
    "engram_pad_token_id",
    "engram_compressed_vocab_size",
)



@pytest.fixture(autouse=True, scope="module")
def _golden_present(golden_dir):
    """Fail (never skip) when the vendored golden data is missing."""


def _text_config(name: str) -> types.SimpleNamespace:
    tc = json.loads((GOLDEN_ROOT / name / "config.json").read_text())["text_config"]
    return types.SimpleNamespace(**{k: tc[k] for k in ENGRAM_FIELDS + ("vocab_size",)})


def _kwargs(cfg: types.SimpleNamespace) -> dict:
    return dict(
        layer_ids=cfg.engram_layer_ids,
        num_embeddings=cfg.engram_num_embeddings,
        max_ngram_size=cfg.engram_max_ngram_size,
        vocab_size=cfg.engram_vocab_size,
        n_heads=cfg.engram_n_heads,
        pad_token_id=cfg.engram_pad_token_id,
        compressed_vocab_size=cfg.engram_compressed_vocab_size,
    )


_HASHERS: dict[str, EngramHasher] = {}


def _hasher(name: str) -> EngramHasher:
    if name not in _HASHERS:
        _HASHERS[name] = EngramHasher.from_model_config(
            _text_config(name), str(GOLDEN_ROOT / name / "tokenizer.json")
        )
    return _HASHERS[name]


@pytest.mark.parametrize("name", CONFIGS)
def test_constants_match_golden(name):
    g = np.load(GOLDEN_ROOT / name / "golden.npz")
    lookup, size = compressed_token_map(str(GOLDEN_ROOT / name / "tokenizer.json"))
    assert size == 95
    np.testing.assert_array_equal(lookup, g["engram_token_map"])
    hs = _hasher(name)
    assert hs.token_map.dtype == np.int64
    np.testing.assert_array_equal(hs.token_map, g["engram_token_map"])
    np.testing.assert_array_equal(hs.primes, g["engram_primes"])
    np.testing.assert_array_equal(hs.offsets, g["engram_offsets"])
    np.testing.assert_array_equal(hs.multipliers, g["engram_multipliers"])
    assert hs.n_layers == 2 and hs.n_hash_cols == 6
    assert hs.pad_id == int(g["engram_token_map"][2])
    np.testing.assert_array_equal(hs.table_rows, _text_config(name).engram_num_embeddings)


@pytest.mark.parametrize("name", CONFIGS)
def test_hash_ids_match_golden(name):
    g = np.load(GOLDEN_ROOT / name / "golden.npz")
    hs = _hasher(name)
    prompt = g["prompt_ids"][0]
    L = prompt.shape[0]
    got = hs.hash_positions(prompt, np.arange(L))
    assert got.dtype == np.int64
    want = g["prefill_engram_hash_ids"][0].reshape(L, hs.n_layers, hs.n_hash_cols)
    np.testing.assert_array_equal(got, want)

    gen = g["generated_ids"][0]
    S = gen.shape[0] - 1
    for s in range(S):
        hist = np.concatenate([prompt, gen[: s + 1]])
        got = hs.hash_positions(hist, np.array([L + s]))
        want = g[f"decode{s}_engram_hash_ids"][0].reshape(1, hs.n_layers, hs.n_hash_cols)
        np.testing.assert_array_equal(got, want, err_msg=f"{name} decode step {s}")

    # Hashing a subset of positions (all decode positions at once) gives the same rows.
    hist = np.concatenate([prompt, gen[:S]])
    got = hs.hash_positions(hist, np.arange(L, L + S))
    want = np.concatenate([g[f"decode{s}_engram_hash_ids"][0] for s in range(S)])
    np.testing.assert_array_equal(got, want.reshape(S, hs.n_layers, hs.n_hash_cols))


def test_compressed_vocab_size_mismatch_raises():
    cfg = _text_config("tiny_fp8")
    kw = _kwargs(cfg)
    kw["compressed_vocab_size"] = 96
    with pytest.raises(ValueError, match="engram_compressed_vocab_size") as ei:
        EngramHasher.build(tokenizer_path=str(GOLDEN_ROOT / "tiny_fp8" / "tokenizer.json"), **kw)
    assert "96" in str(ei.value) and "95" in str(ei.value)


def test_num_embeddings_mismatch_raises():
    cfg = _text_config("tiny_fp8")
    kw = _kwargs(cfg)
    kw["num_embeddings"] = [384, 553]
    with pytest.raises(ValueError, match="engram_num_embeddings") as ei:
        EngramHasher.build(tokenizer_path=str(GOLDEN_ROOT / "tiny_fp8" / "tokenizer.json"), **kw)
    assert "553" in str(ei.value) and "552" in str(ei.value) and "layer 1" in str(ei.value)


def test_is_prime_small_and_large():
    sieve = [True] * 2000
    sieve[0] = sieve[1] = False
    for i in range(2, 2000):
        if sieve[i]:
            for j in range(i * i, 2000, i):
                sieve[j] = False
    assert [n for n in range(2000) if is_prime(n)] == [n for n in range(2000) if sieve[n]]
    assert is_prime(2**61 - 1) and is_prime(18446744073709551557)  # largest 64-bit prime
    assert not is_prime(3215031751)  # strong pseudoprime to bases 2, 3, 5, 7
    assert not is_prime(3825123056546413051)  # strong pseudoprime to bases 2..23


def _oracle(token_map, pad_id, primes, multipliers, tokens, live, p):
    """Slow, loop-based reference of one position's hash row (independent of hash_positions)."""
    n_layers, n_grams, n_heads = primes.shape
    K = n_grams + 1
    ts = []
    blocked = False
    for k in range(K):
        q = p - k
        if q < 0:
            ts.append(int(pad_id))
            continue
        if not live[q]:
            blocked = True
        ts.append(int(pad_id) if blocked else int(token_map[tokens[q]]))
    out = []
    for layer in range(n_layers):
        row = []
        offset = 0
        x = ts[0] * int(multipliers[layer, 0])
        for i in range(1, K):
            x ^= ts[i] * int(multipliers[layer, i])
            for h in range(n_heads):
                prime = int(primes[layer, i - 1, h])
                row.append(x % prime + offset)
                offset += prime
        out.append(row)
    return out


def test_dead_token_masking():
    # Hand-sized: identity map over 10 ids, pad token 0 -> compressed 0, 3-grams, 2 heads.
    token_map, size = identity_token_map(10)
    hs = EngramHasher.build(
        tokenizer_path=None,
        token_map=token_map,
        layer_ids=[0, 3],
        num_embeddings=[11 + 13 + 17 + 19, 23 + 29 + 31 + 37],
        max_ngram_size=3,
        vocab_size=11,
        n_heads=2,
        pad_token_id=0,
        compressed_vocab_size=size,
    )
    np.testing.assert_array_equal(hs.primes, [[[11, 13], [17, 19]], [[23, 29], [31, 37]]])
    tokens = np.array([5, 7, 9, 4, 4, 2, 8, 1])
    live = np.array([True, True, False, True, True, False, False, True])
    pos = np.arange(len(tokens))
    got = hs.hash_positions(tokens, pos, live=live)
    want = [_oracle(hs.token_map, hs.pad_id, hs.primes, hs.multipliers, tokens, live, p) for p in pos]
    np.testing.assert_array_equal(got, np.array(want, dtype=np.int64))

    # Masking really matters: at p=3 the 2-gram sees token 4 then pad (9 at p=2 is dead), and
    # the 3-gram must also use pad for p=1 (blocked past the dead token) even though 7 is live.
    m = hs.multipliers
    x2 = (4 * int(m[0, 0])) ^ (0 * int(m[0, 1]))
    x3 = x2 ^ (0 * int(m[0, 2]))
    assert got[3, 0].tolist() == [x2 % 11, 11 + x2 % 13, 24 + x3 % 17, 41 + x3 % 19]
    all_live = hs.hash_positions(tokens, pos)
    assert not np.array_equal(got[3], all_live[3])
    np.testing.assert_array_equal(
        all_live,
        np.array(
            [_oracle(hs.token_map, hs.pad_id, hs.primes, hs.multipliers, tokens,
                     np.ones(len(tokens), bool), p) for p in pos],
            dtype=np.int64,
        ),
    )
    # A dead position hashes to the all-pad n-grams.
    pad_row = hs.hash_positions(np.array([0, 0, 0]), np.array([0]))[0]
    np.testing.assert_array_equal(got[5], pad_row)
    np.testing.assert_array_equal(got[6], pad_row)


def test_input_validation():
    hs = _hasher("tiny_fp8")
    with pytest.raises(ValueError, match="positions"):
        hs.hash_positions(np.array([3, 4]), np.array([2]))
    with pytest.raises(ValueError, match="token_ids"):
        hs.hash_positions(np.array([3, 256]), np.array([0]))
    with pytest.raises(ValueError, match="live"):
        hs.hash_positions(np.array([3, 4]), np.array([0]), live=np.array([True]))
    kw = _kwargs(_text_config("tiny_fp8"))
    kw["max_ngram_size"] = 1
    with pytest.raises(ValueError, match="engram_max_ngram_size"):
        EngramHasher.build(tokenizer_path=str(GOLDEN_ROOT / "tiny_fp8" / "tokenizer.json"), **kw)
