"""Engram n-gram hashing of DeepSeek-V4.1 (host side; pure numpy + ``tokenizers``).

Engram layers add to the residual stream an embedding looked up from large
hashed n-gram tables. This module computes the *row indices* into those tables;
it does no device work and deliberately imports no JAX.

The pipeline, exactly as the reference ``engram.py`` does it:

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

4. **Hash.** For position p, the token k steps back is ``t_k = c[p-k]`` (c =
   compressed ids), or the compressed pad id where ``p-k < 0`` or the look-back
   reaches a dead token (e.g. an image placeholder; once a shift is blocked all
   larger shifts are too). With ``x_k = t_k * mult[layer, k]``, the n-gram hash
   of size n = i+1 is ``x_0 ^ x_1 ^ ... ^ x_i``, reduced modulo
   ``primes[layer, i-1, h]`` for each head h and shifted by the matching row
   offset. Output columns per layer: (2-gram h0, h1, ..., 3-gram h0, ...).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

__all__ = [
    "EngramHasher",
    "compressed_token_map",
    "identity_token_map",
    "engram_primes",
    "engram_offsets",
    "engram_multipliers",
    "is_prime",
    "LAYER_SEED_PRIME",
]

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


# --------------------------------------------------------------------------- hasher


@dataclasses.dataclass(frozen=True, eq=False)
class EngramHasher:
    """Host-side Engram hash constants plus the vectorised hash.

    ``eq=False``: the fields are numpy arrays, so instances compare and hash by identity.
    """

    token_map: np.ndarray  # int64 [vocab]
    pad_id: int  # compressed id of the pad token
    primes: np.ndarray  # int64 [n_layers, max_ngram-1, n_heads]
    offsets: np.ndarray  # int64 [n_layers, (max_ngram-1)*n_heads]
    multipliers: np.ndarray  # int64 [n_layers, max_ngram]
    max_ngram_size: int

    @property
    def n_layers(self) -> int:
        return int(self.primes.shape[0])

    @property
    def n_heads(self) -> int:
        return int(self.primes.shape[2])

    @property
    def n_hash_cols(self) -> int:
        """Columns per layer: (max_ngram-1) * n_heads."""
        return int(self.primes.shape[1] * self.primes.shape[2])

    @property
    def table_rows(self) -> np.ndarray:
        """Rows of each layer's stacked table (== engram_num_embeddings), int64 [n_layers]."""
        return self.primes.reshape(self.n_layers, -1).sum(axis=1)

    # ------------------------------------------------------------------ construction

    @classmethod
    def build(
        cls,
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
    ) -> "EngramHasher":
        """Build from config values. ``vocab_size`` is ``engram_vocab_size`` (the prime search base).

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
        return cls(
            token_map=lookup,
            pad_id=int(lookup[pad_token_id]),
            primes=primes,
            offsets=offsets,
            multipliers=multipliers,
            max_ngram_size=max_ngram_size,
        )

    @classmethod
    def from_model_config(
        cls, cfg: Any, tokenizer_path: str | None = None, token_map: np.ndarray | None = None
    ) -> "EngramHasher":
        """Build from any object with the ``engram_*`` config attributes (duck-typed).

        Without a tokenizer or token map, an identity map over ``cfg.vocab_size`` (or, if the
        config has no ``vocab_size``, over ``engram_compressed_vocab_size``) is used.
        """
        if tokenizer_path is None and token_map is None:
            n = getattr(cfg, "vocab_size", None)
            if n is None:
                n = cfg.engram_compressed_vocab_size
            token_map, _ = identity_token_map(n)
        return cls.build(
            tokenizer_path=tokenizer_path,
            token_map=token_map,
            layer_ids=cfg.engram_layer_ids,
            num_embeddings=cfg.engram_num_embeddings,
            max_ngram_size=cfg.engram_max_ngram_size,
            vocab_size=cfg.engram_vocab_size,
            n_heads=cfg.engram_n_heads,
            pad_token_id=cfg.engram_pad_token_id,
            compressed_vocab_size=cfg.engram_compressed_vocab_size,
        )

    # ------------------------------------------------------------------ hashing

    def hash_positions(
        self,
        token_ids: np.ndarray,
        positions: np.ndarray,
        live: np.ndarray | None = None,
    ) -> np.ndarray:
        """Hash ids of one request at ``positions``.

        token_ids: int [N], the request's token history (ids for positions 0..N-1).
        positions: int [n], positions to hash, each in [0, N).
        live: optional bool [N]; False marks dead tokens (e.g. image placeholders).
        Returns int64 [n, n_layers, (max_ngram-1)*n_heads], row offsets included.
        """
        token_ids = np.asarray(token_ids)
        positions = np.asarray(positions)
        if token_ids.ndim != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {token_ids.shape}")
        if positions.ndim != 1:
            raise ValueError(f"positions must be 1-D, got shape {positions.shape}")
        n_tok = token_ids.shape[0]
        token_ids = token_ids.astype(np.int64, copy=False)
        positions = positions.astype(np.int64, copy=False)
        if positions.size and (positions.min() < 0 or positions.max() >= n_tok):
            raise ValueError(
                f"positions must lie in [0, {n_tok}), got range "
                f"[{int(positions.min())}, {int(positions.max())}]"
            )
        vocab = self.token_map.shape[0]
        if token_ids.size and (token_ids.min() < 0 or token_ids.max() >= vocab):
            raise ValueError(
                f"token_ids must lie in [0, {vocab}), got range "
                f"[{int(token_ids.min())}, {int(token_ids.max())}]"
            )

        K = self.max_ngram_size
        src = positions[:, None] - np.arange(K, dtype=np.int64)[None, :]  # [n, K]
        valid = src >= 0
        src_c = np.where(valid, src, 0)
        usable = valid
        if live is not None:
            live = np.asarray(live, dtype=bool)
            if live.shape != (n_tok,):
                raise ValueError(f"live must have shape ({n_tok},), got {live.shape}")
            dead = valid & ~live[src_c]
            blocked = np.logical_or.accumulate(dead, axis=1)
            usable = valid & ~blocked
        comp = self.token_map[token_ids]  # [N]
        t = np.where(usable, comp[src_c], np.int64(self.pad_id))  # [n, K]

        # [n, L, K]; no overflow: t < compressed size, multiplier < int64_max // compressed size.
        prods = t[:, None, :] * self.multipliers[None, :, :]
        rolling = np.bitwise_xor.accumulate(prods, axis=2)[:, :, 1:]  # [n, L, K-1]
        h = np.mod(rolling[:, :, :, None], self.primes[None])  # [n, L, K-1, H]
        h = h.reshape(h.shape[0], self.n_layers, self.n_hash_cols)
        return h + self.offsets[None]
