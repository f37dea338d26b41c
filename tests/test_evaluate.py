"""Held-out bits per byte (training/evaluate.py): every token but the first is predicted once,
padding is never counted, and the figure is the summed code length over the bytes."""

from __future__ import annotations

import math

import numpy as np
import pytest

from deepinfer_jax.training.evaluate import bits_per_byte, windows

PAD = 2


def test_windows_predict_every_token_once():
    t = np.arange(10, 33)  # 23 tokens, none equal to PAD
    w = windows(t, seq_len=5, pad_id=PAD)
    targets = np.concatenate([row[1:][row[1:] != PAD] for row in w])
    np.testing.assert_array_equal(targets, t[1:])  # each predicted exactly once, in order
    assert all(w[i + 1, 0] == w[i, -1] for i in range(len(w) - 1))  # context carried by one token


def _uniform_loss(V):
    """A model that spreads its mass evenly: nll ln V for every non-pad target."""
    def loss_fn(tokens_BL):
        n = float((tokens_BL[:, 1:] != PAD).sum())
        return math.log(V), n
    return loss_fn


@pytest.mark.parametrize("seq_len,batch", [(4, 1), (7, 3), (64, 8)])
def test_uniform_model_codes_log2_V_bits_per_token(seq_len, batch):
    rng = np.random.default_rng(0)
    t = rng.integers(3, 300, size=101)
    r = bits_per_byte(_uniform_loss(256), t, n_bytes=400, seq_len=seq_len, batch=batch, pad_id=PAD, progress=False)
    assert r["tokens"] == 100  # padding rows and padded positions are not counted
    assert r["bits_per_token"] == pytest.approx(8.0)
    assert r["bits_per_byte"] == pytest.approx(100 * 8.0 / 400)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="seq_len=1"):
        windows(np.arange(5), 1, PAD)
    with pytest.raises(ValueError, match="n_bytes=0"):
        bits_per_byte(_uniform_loss(4), np.arange(5), 0, 4, 1, PAD)
