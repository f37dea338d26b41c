"""Repeated tails: DSpark training windows that end the way the target's greedy text often ends.

A small model's greedy continuation falls into loops: from some position on it repeats its last
``P`` tokens. The target copies such a loop exactly, so a draft that copies it would be accepted
all along, but drafts trained on real text only see loops rarely, and the shipped stages match
the target no better inside loops than outside (``scripts/eval/dspark_loops.py``).

``RepeatTail`` wraps a batch source: in a fraction ``frac`` of the rows, from a start ``s`` drawn
in ``[L/4, 3L/4)`` every token is replaced by the period of ``P`` tokens just before it (``P``
drawn in ``[min_period, max_period]``), i.e. the row reads ``text[:s]`` then ``text[s-P:s]`` over
and over. The labels stay the target's own logits on that text (the DSpark loss), so the draft
learns what the target does on loops.

Deterministic in ``(seed, batch index)``, like the batches, so a resumed run sees what a straight
run sees.
"""

from __future__ import annotations

from typing import Callable

import numpy as np


class RepeatTail:
    def __init__(self, batches: Callable[[int], np.ndarray], frac: float, seed: int = 0,
                 min_period: int = 2, max_period: int = 64):
        if not 0.0 <= frac <= 1.0:
            raise ValueError(f"repeat frac={frac!r}: must be in [0, 1]")
        if not 1 <= min_period <= max_period:
            raise ValueError(f"repeat periods [{min_period}, {max_period}]: need 1 <= min_period <= max_period")
        self.batches, self.frac, self.seed = batches, float(frac), seed
        self.min_period, self.max_period = min_period, max_period

    def __call__(self, index: int) -> np.ndarray:
        toks = np.array(self.batches(index), copy=True)
        if self.frac == 0.0:
            return toks
        B, L = toks.shape
        rng = np.random.default_rng([self.seed, index, 0x5EED])
        pick = rng.random(B) < self.frac
        lo, hi = L // 4, max(L // 4 + 1, (3 * L) // 4)
        if lo < self.min_period:
            raise ValueError(f"seq_len={L}: repeated tails need seq_len >= 4 * min_period = {4 * self.min_period}")
        for b in np.flatnonzero(pick):
            s = int(rng.integers(lo, hi))
            P = int(rng.integers(self.min_period, min(self.max_period, s) + 1))
            toks[b, s:] = np.resize(toks[b, s - P:s], L - s)
        return toks


def loop_mask(tokens_L: np.ndarray, max_period: int = 64, min_len: int = 8) -> np.ndarray:
    """bool ``[L]``: position ``t`` ends a loop, i.e. for some period ``P <= max_period`` the last
    ``max(2P, min_len)`` tokens up to ``t`` repeat with period ``P`` (what ``RepeatTail`` writes,
    and what a greedy continuation that fell into a loop looks like)."""
    row = np.asarray(tokens_L)
    L = len(row)
    out = np.zeros(L, bool)
    for P in range(1, max_period + 1):
        n = max(2 * P, min_len)
        if n > L:
            break
        w = n - P   # the window repeats with period P iff its last w tokens equal those P before
        cs = np.concatenate([[0], np.cumsum(row[P:] == row[:-P])])   # cs[i]: matches among t = P .. P+i-1
        t = np.arange(n - 1, L)
        out[t] |= cs[t - P + 1] - cs[t - P + 1 - w] == w
    return out
