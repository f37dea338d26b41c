"""Repeated tails for DSpark training (training/repeat_tail.py): rows end in the period just before
the repeat starts, deterministically per batch index, the other rows untouched."""

import numpy as np
import pytest

from deepinfer_jax.training.data import TokenBatches
from deepinfer_jax.training.repeat_tail import RepeatTail


def _source(seed=0, B=16, L=96):
    toks = np.random.default_rng(seed).integers(3, 5000, size=20_000).astype(np.int32)
    return TokenBatches(toks, B, L, seed=1)


def _repeat_start(orig, row):
    """(s, P) when ``row`` is ``orig[:s]`` then ``orig[s-P:s]`` repeated, else None."""
    L = len(row)
    diff = np.flatnonzero(orig != row)
    if len(diff) == 0:
        return None
    for s in range(1, diff[0] + 1):
        for P in range(1, s + 1):
            if np.array_equal(row[s:], np.resize(orig[s - P:s], L - s)) and np.array_equal(row[:s], orig[:s]):
                return s, P
    return None


def test_every_row_repeats_its_last_period_from_a_start_in_the_middle_half():
    src = _source()
    aug = RepeatTail(src, frac=1.0, seed=3, min_period=2, max_period=12)
    orig, rows = src(5), aug(5)
    for o, r in zip(orig, rows):
        found = _repeat_start(o, r)
        assert found is not None, "row is not the original text followed by a repeated period"
        s, P = found
        assert 96 // 4 <= s < 3 * 96 // 4 and 1 <= P <= 12
        assert np.array_equal(r[s:s + P], o[s - P:s])


def test_fraction_zero_is_the_data_and_the_draw_is_deterministic_per_index():
    src = _source()
    assert np.array_equal(RepeatTail(src, 0.0)(2), src(2))
    aug = RepeatTail(src, frac=0.5, seed=7)
    a, b = aug(4), RepeatTail(src, frac=0.5, seed=7)(4)
    assert np.array_equal(a, b)                      # a resumed run reads what a straight run read
    changed = (a != src(4)).any(axis=1)
    assert 0 < changed.sum() < len(changed)          # about half the rows, not none and not all
    assert not np.array_equal(aug(5) != src(5), a != src(4))


@pytest.mark.parametrize("kw, field", [(dict(frac=1.5), "frac=1.5"), (dict(frac=0.5, min_period=0), "[0, 64]"),
                                       (dict(frac=0.5, min_period=9, max_period=4), "[9, 4]")])
def test_bad_settings_are_named(kw, field):
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        RepeatTail(_source(), **kw)


def test_too_short_windows_for_the_period_are_refused():
    with pytest.raises(ValueError, match="seq_len=8"):
        RepeatTail(_source(L=8), frac=1.0, min_period=4, max_period=4)(0)


def test_loop_mask_finds_the_repeated_tails_and_nothing_in_random_text():
    from deepinfer_jax.training.repeat_tail import loop_mask

    src = _source()
    rows = RepeatTail(src, frac=1.0, seed=3, min_period=2, max_period=12)(5)
    for o, r in zip(src(5), rows):
        s, P = _repeat_start(o, r)
        m = loop_mask(r, max_period=12)
        assert m[s + max(2 * P, 8) - P:].all()            # every position once the loop has shown itself
    assert not loop_mask(src(5)[0], max_period=12).any()  # random ids from 5,000: no loop of 8 tokens
    np.testing.assert_array_equal(loop_mask(np.array([1, 2, 1, 2, 1, 2, 1, 2, 1, 7])),
                                  [0, 0, 0, 0, 0, 0, 0, 1, 1, 0])
