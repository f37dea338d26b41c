"""Engram n-gram hashing of DeepSeek-V4.1 (host side; pure numpy + ``tokenizers``).

Engram layers add to the residual stream an embedding looked up from large
hashed n-gram tables. This module computes the *row indices* into those tables;
it does no device work and deliberately imports no JAX.

The static tables (compressed token map, primes, offsets, multipliers) come from
``base/engram_tables.py``; the hash itself, exactly as the reference ``engram.py`` does it:

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
from typing import Any

import numpy as np

from deepinfer_jax.base.engram_tables import (  # noqa: F401  (re-exported)
    LAYER_SEED_PRIME,
    compressed_token_map,
    engram_constants,
    engram_multipliers,
    engram_offsets,
    engram_primes,
    identity_token_map,
    is_prime,
)

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
    def build(cls, **config) -> "EngramHasher":
        """Build from config values: the keywords of ``base.engram_tables.engram_constants``,
        which checks them against each other and computes the tables. Exactly one of
        ``tokenizer_path`` / ``token_map`` must be given."""
        return cls(**engram_constants(**config))

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
        return self._hash_compressed(t)

    def hash_windows(self, window_nK: np.ndarray) -> np.ndarray:
        """Hash ids from look-back windows, many positions (of any requests) in one call:
        ``window_nK[i, k]`` is the token id at ``p_i - k`` (k = 0..K-1), or -1 where ``p_i - k < 0``
        (the pad id). Same output as :meth:`hash_positions` (which has dead-token support)."""
        return self._hash_compressed(self.compress_windows(window_nK))

    def compress_windows(self, window_nK: np.ndarray) -> np.ndarray:
        """Look-back windows (token ids, -1 before position 0) -> compressed ids with the pad id,
        int64 ``[n, K]``; checks the shape and the id range."""
        w = np.asarray(window_nK, np.int64)
        if w.ndim != 2 or w.shape[1] != self.max_ngram_size:
            raise ValueError(f"window_nK must have shape [n, {self.max_ngram_size}], got {w.shape}")
        vocab = self.token_map.shape[0]
        if w.size and (w.min() < -1 or w.max() >= vocab):
            raise ValueError(f"window token ids must lie in [0, {vocab}) or be -1, got range "
                             f"[{int(w.min())}, {int(w.max())}]")
        return np.where(w >= 0, self.token_map[np.maximum(w, 0)], np.int64(self.pad_id))

    def _hash_compressed(self, t_nK: np.ndarray) -> np.ndarray:
        # [n, L, K]; no overflow: t < compressed size, multiplier < int64_max // compressed size.
        prods = t_nK[:, None, :] * self.multipliers[None, :, :]
        rolling = np.bitwise_xor.accumulate(prods, axis=2)[:, :, 1:]  # [n, L, K-1]
        h = np.mod(rolling[:, :, :, None], self.primes[None])  # [n, L, K-1, H]
        h = h.reshape(h.shape[0], self.n_layers, self.n_hash_cols)
        return h + self.offsets[None]
