"""Held-out bits per byte of a language model on a token stream (the quality figure of the trained
model, compared with ``gzip -9`` / ``xz -9e`` on the same bytes: ``compression_baseline.py``).

The stream (``heldout.npy``: documents each followed by ``<eos>``) is cut into windows of
``seq_len`` tokens that overlap by one, so every token but the first is predicted exactly once,
from the tokens before it in its window (the context restarts at each window: a conservative
figure for a model that could see more). The last window is padded with the pad id, which is not
counted. ``bits per byte = sum of -log2 p(token) / bytes``, the ``<eos>`` predictions included
(the file boundaries are part of the text the model must code).
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
from tqdm.auto import tqdm


def windows(tokens_N: np.ndarray, seq_len: int, pad_id: int) -> np.ndarray:
    """``[W, seq_len]`` windows overlapping by one token, the last one padded with ``pad_id``."""
    if seq_len < 2:
        raise ValueError(f"seq_len={seq_len}: must be >= 2")
    t = np.asarray(tokens_N).reshape(-1)
    if t.size < 2:
        raise ValueError(f"tokens: {t.size} tokens, need at least 2 to predict one")
    step = seq_len - 1
    n = -(-(t.size - 1) // step)
    out = np.full((n, seq_len), pad_id, dtype=np.int32)
    for i in range(n):
        w = t[i * step:i * step + seq_len]
        out[i, :w.size] = w
    return out


def bits_per_byte(loss_fn: Callable[[np.ndarray], tuple[float, float]], tokens_N: np.ndarray, n_bytes: int,
                  seq_len: int, batch: int, pad_id: int, progress: bool = True) -> dict:
    """``loss_fn(tokens_BL) -> (mean next-token nll in nats over non-pad targets, their count)``
    (``Trainer``'s loss). Returns bits per byte, bits per token, the tokens counted and bytes."""
    if n_bytes < 1:
        raise ValueError(f"n_bytes={n_bytes}: must be >= 1")
    if batch < 1:
        raise ValueError(f"batch={batch}: must be >= 1")
    w = windows(tokens_N, seq_len, pad_id)
    pad_rows = -len(w) % batch
    if pad_rows:  # whole batches (one compiled shape); padding rows predict nothing
        w = np.concatenate([w, np.full((pad_rows, seq_len), pad_id, np.int32)])
    total_nats, counted = 0.0, 0.0
    for i in tqdm(range(0, len(w), batch), desc="held-out", unit="batch", disable=not progress):
        mean, n = loss_fn(w[i:i + batch])
        total_nats += float(mean) * float(n)
        counted += float(n)
    bits = total_nats / math.log(2)
    return {"bits_per_byte": bits / n_bytes, "bits_per_token": bits / max(counted, 1.0),
            "tokens": int(counted), "bytes": int(n_bytes), "seq_len": seq_len}
