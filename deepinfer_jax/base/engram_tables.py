"""The static tables of DeepSeek-V4.1's Engram n-gram hash (pure numpy + ``tokenizers``, no JAX).

Engram layers add to the residual stream an embedding looked up from large hashed n-gram tables.
This module holds what the hash is built from, which the checkpoint (table sizes) and the host
hasher (``runner/engram_hash.py``) both need:

1. **Compressed token map.** Every token id of the tokenizer is decoded on its
   own and normalised (NFKC, NFD, strip accents, lowercase, collapse whitespace
   runs to one space, strip -- a token that is exactly whitespace stays a single
   space). Tokens whose normalised text is equal share one compressed id, ids
   assigned in order of first appearance. A token whose decode contains U+FFFD
   (a partial UTF-8 byte token) is keyed by its raw vocabulary string instead.
   The number of distinct keys is ``engram_compressed_vocab_size``.

2. **Primes.** Each (engram layer, n-gram size n in 2..max_ngram, head h) gets
   its own prime table size: the smallest prime above a running value that no
   earlier (layer, n, head) has taken. The running value restarts at
   ``engram_vocab_size - 1`` for each (layer, n) and moves to the prime just
   taken for the next head. A layer's tables are stacked in one embedding of
   ``sum(primes[layer])`` rows (== ``engram_num_embeddings[layer]``); the
   ``offsets`` are the exclusive cumulative sum of the layer's primes in
   (n-gram major, head minor) order.

3. **Multipliers.** One odd int64 per (layer, look-back shift k in
   0..max_ngram-1), drawn from ``numpy.random.default_rng(10007 * layer_id)``
   and bounded so ``compressed_id * multiplier`` cannot overflow int64.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

LAYER_SEED_PRIME = 10007
_INT64_MAX = int(np.iinfo(np.int64).max)
# The first 12 primes are a deterministic Miller-Rabin witness set for n < 3.3e24.
_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


# --------------------------------------------------------------------------- primes


def is_prime(n: int) -> bool:
    """Deterministic primality test (Miller-Rabin, exact for every n < 3.3e24)."""
    n = int(n)
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x == 1 or x == n - 1:
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def engram_primes(
    num_layers: int, max_ngram_size: int, n_heads: int, vocab_size: int
) -> np.ndarray:
    """Per-(layer, n-gram, head) table sizes, int64 [num_layers, max_ngram-1, n_heads].

    Distinct primes globally; each (layer, n-gram) search starts above ``vocab_size - 1``.
    """
    used: set[int] = set()
    out = np.zeros((num_layers, max_ngram_size - 1, n_heads), dtype=np.int64)
    for li in range(num_layers):
        for gi in range(max_ngram_size - 1):
            current = int(vocab_size) - 1
            for h in range(n_heads):
                cand = current + 1
                while cand in used or not is_prime(cand):
                    cand += 1
                if cand > _INT64_MAX:
                    raise ValueError(f"engram_vocab_size={vocab_size}: prime {cand} exceeds int64")
                used.add(cand)
                out[li, gi, h] = cand
                current = cand
    return out


def engram_offsets(primes: np.ndarray) -> np.ndarray:
    """Row offset of each (n-gram, head) table in its layer: int64 [n_layers, (max_ngram-1)*n_heads]."""
    flat = np.asarray(primes, dtype=np.int64).reshape(primes.shape[0], -1)
    offs = np.zeros_like(flat)
    offs[:, 1:] = np.cumsum(flat[:, :-1], axis=1)
    return offs


def engram_multipliers(
    layer_ids: Sequence[int], max_ngram_size: int, compressed_vocab_size: int
) -> np.ndarray:
    """Odd per-(layer, shift) hash multipliers, int64 [n_layers, max_ngram]."""
    bound = max(1, (_INT64_MAX // int(compressed_vocab_size)) // 2)
    rows = []
    for layer_id in layer_ids:
        rng = np.random.default_rng(LAYER_SEED_PRIME * int(layer_id))
        values = rng.integers(low=0, high=bound, size=(max_ngram_size,), dtype=np.int64)
        rows.append(values * 2 + 1)
    return np.stack(rows).astype(np.int64)


# --------------------------------------------------------------------------- token map


def _engram_normalizer():
    from tokenizers import Regex, normalizers

    sentinel = "\ue000"  # private-use char, so a token that is exactly one space survives Strip()
    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), sentinel),
            normalizers.Strip(),
            normalizers.Replace(sentinel, " "),
        ]
    )


def compressed_token_map(tokenizer_path: str) -> tuple[np.ndarray, int]:
    """(lookup int64 [vocab incl. added tokens], compressed_vocab_size) from a ``tokenizer.json``."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    normalizer = _engram_normalizer()
    vocab = tok.get_vocab_size(with_added_tokens=True)
    lookup = np.empty(vocab, dtype=np.int64)
    key_ids: dict[str, int] = {}
    for tid in range(vocab):
        text = tok.decode([tid], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tok.id_to_token(tid)
            if key is None:  # id without a vocabulary entry; fall back to its decoded text
                key = text
        else:
            normalized = normalizer.normalize_str(text)
            key = normalized if normalized else text
        lookup[tid] = key_ids.setdefault(key, len(key_ids))
    return lookup, len(key_ids)


def identity_token_map(vocab_size: int) -> tuple[np.ndarray, int]:
    """Token map for models without a tokenizer: id -> id, compressed size = vocab size."""
    vocab_size = int(vocab_size)
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    return np.arange(vocab_size, dtype=np.int64), vocab_size


def engram_table_rows(num_layers: int, max_ngram_size: int, n_heads: int, vocab_size: int) -> tuple[int, ...]:
    """Rows of each Engram layer's stacked table (``engram_num_embeddings``): its primes summed."""
    primes = engram_primes(num_layers, max_ngram_size, n_heads, vocab_size)
    return tuple(int(r) for r in primes.reshape(num_layers, -1).sum(axis=1))


# --------------------------------------------------------------------------- constants


def engram_constants(
    *,
    tokenizer_path: str | None,
    token_map: np.ndarray | None = None,
    layer_ids: Sequence[int],
    num_embeddings: Sequence[int],
    max_ngram_size: int,
    vocab_size: int,
    n_heads: int,
    pad_token_id: int,
    compressed_vocab_size: int,
) -> dict[str, Any]:
    """The hash constants of an Engram config, checked against each other: a dict of
    ``EngramHasher``'s fields. ``vocab_size`` is ``engram_vocab_size`` (the prime search base).

    Exactly one of ``tokenizer_path`` / ``token_map`` must be given. For an explicit
    ``token_map`` the compressed size is taken as ``max(token_map) + 1``.
    """
    layer_ids = [int(x) for x in layer_ids]
    num_embeddings = [int(x) for x in num_embeddings]
    max_ngram_size = int(max_ngram_size)
    n_heads = int(n_heads)
    vocab_size = int(vocab_size)
    pad_token_id = int(pad_token_id)
    compressed_vocab_size = int(compressed_vocab_size)

    if not layer_ids:
        raise ValueError(f"engram_layer_ids must be non-empty, got {layer_ids}")
    if len(set(layer_ids)) != len(layer_ids) or min(layer_ids) < 0:
        raise ValueError(f"engram_layer_ids must be distinct and >= 0, got {layer_ids}")
    if len(num_embeddings) != len(layer_ids):
        raise ValueError(
            f"engram_num_embeddings={num_embeddings} must have one entry per "
            f"engram_layer_ids={layer_ids}"
        )
    if max_ngram_size < 2:
        raise ValueError(f"engram_max_ngram_size must be >= 2, got {max_ngram_size}")
    if n_heads < 1:
        raise ValueError(f"engram_n_heads must be >= 1, got {n_heads}")
    if vocab_size < 1:
        raise ValueError(f"engram_vocab_size must be >= 1, got {vocab_size}")
    if compressed_vocab_size < 1:
        raise ValueError(
            f"engram_compressed_vocab_size must be >= 1, got {compressed_vocab_size}"
        )

    if (tokenizer_path is None) == (token_map is None):
        raise ValueError("give exactly one of tokenizer_path / token_map")
    if tokenizer_path is not None:
        lookup, computed = compressed_token_map(tokenizer_path)
    else:
        lookup = np.asarray(token_map)
        if lookup.ndim != 1 or lookup.size == 0 or not np.issubdtype(lookup.dtype, np.integer):
            raise ValueError(
                f"token_map must be a non-empty 1-D integer array, got shape "
                f"{lookup.shape} dtype {lookup.dtype}"
            )
        lookup = lookup.astype(np.int64)
        if lookup.min() < 0:
            raise ValueError(f"token_map has a negative entry {int(lookup.min())}")
        computed = int(lookup.max()) + 1
    if computed != compressed_vocab_size:
        raise ValueError(
            f"engram_compressed_vocab_size={compressed_vocab_size} does not match the "
            f"compressed vocabulary size computed from the token map ({computed})"
        )
    if not 0 <= pad_token_id < lookup.shape[0]:
        raise ValueError(
            f"engram_pad_token_id={pad_token_id} outside the token map [0, {lookup.shape[0]})"
        )

    primes = engram_primes(len(layer_ids), max_ngram_size, n_heads, vocab_size)
    rows = primes.reshape(len(layer_ids), -1).sum(axis=1)
    for i, (lid, want) in enumerate(zip(layer_ids, num_embeddings)):
        if int(rows[i]) != want:
            raise ValueError(
                f"engram_num_embeddings[{i}] (layer {lid}) = {want}, but the layer's primes "
                f"sum to {int(rows[i])} rows"
            )
    offsets = engram_offsets(primes)
    multipliers = engram_multipliers(layer_ids, max_ngram_size, compressed_vocab_size)

    for arr in (lookup, primes, offsets, multipliers):
        arr.setflags(write=False)
    return dict(
        token_map=lookup,
        pad_id=int(lookup[pad_token_id]),
        primes=primes,
        offsets=offsets,
        multipliers=multipliers,
        max_ngram_size=max_ngram_size,
    )
