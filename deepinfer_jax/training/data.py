"""Token data: a 1-D array of token ids (``.npy``, or ``.bin`` of little-endian uint16 / int32 by
the ``dtype`` argument) and a deterministic batch order. Batch ``i`` is ``B`` windows of
``L`` tokens at offsets drawn by a generator seeded by ``(seed, i)``, so the data position of a
run is its step count and a resumed run reads the batches a straight run reads. ``aligned``: the
array is a stack of sequences of ``L`` tokens each (``runner/regenerate.py``'s output), and
windows are whole sequences, never two halves."""

from __future__ import annotations

import os

import numpy as np


def load_tokens(path: str | os.PathLike, dtype: str = "uint16") -> np.ndarray:
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"data file not found: {path}")
    if path.endswith(".npy"):
        arr = np.load(path, mmap_mode="r")
    else:
        arr = np.memmap(path, dtype=np.dtype(dtype), mode="r")
    if arr.ndim != 1:
        raise ValueError(f"data file {path}: expected a 1-D array of token ids, got shape {arr.shape}")
    return arr


class TokenBatches:
    def __init__(self, tokens: np.ndarray, batch: int, seq_len: int, seed: int = 0, vocab_size: int | None = None,
                 aligned: bool = False):
        if len(tokens) < seq_len:
            raise ValueError(f"data: {len(tokens)} tokens < seq_len={seq_len}")
        if aligned and len(tokens) % seq_len:
            raise ValueError(f"data: aligned windows need a multiple of seq_len={seq_len} tokens, got {len(tokens)}")
        if vocab_size is not None and len(tokens):
            hi = int(np.max(tokens))
            if hi >= vocab_size:
                raise ValueError(f"data: token id {hi} >= vocab_size={vocab_size}")
        self.tokens, self.batch, self.seq_len, self.seed, self.aligned = tokens, batch, seq_len, seed, aligned

    def __call__(self, index: int) -> np.ndarray:
        """int32 ``[batch, seq_len]`` of batch ``index``."""
        rng = np.random.default_rng([self.seed, index])
        if self.aligned:
            starts = rng.integers(0, len(self.tokens) // self.seq_len, size=self.batch) * self.seq_len
        else:
            starts = rng.integers(0, len(self.tokens) - self.seq_len + 1, size=self.batch)
        return np.stack([np.asarray(self.tokens[s:s + self.seq_len]) for s in starts]).astype(np.int32)


def repeating_pattern(n_tokens: int, period: int, vocab_size: int, seed: int = 0, low: int = 3) -> np.ndarray:
    """Synthetic data: one random phrase of ``period`` ids in ``[low, vocab_size)`` repeated."""
    phrase = np.random.default_rng(seed).integers(low, vocab_size, size=period)
    return np.resize(phrase, n_tokens).astype(np.int32)
