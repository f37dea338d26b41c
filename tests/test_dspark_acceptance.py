"""DSpark acceptance measurement (``runner/spec_acceptance.py``) on v41-tiny random weights.

* temperature 0: draft -> verify -> commit generates exactly ``SequenceDriver.generate_greedy``'s
  tokens (prompts shorter and longer than the 8-slot window ring; random drafts are nearly always
  rejected, so almost every round rolls the cache back and recommits);
* drafts forced to the greedy continuation give tau = blk + 1 (the keep-the-verification-cache
  path) and still the greedy tokens; drafts forced wrong give tau = 1;
* temperature > 0: a seed reproduces the run; the verification rule is lossless (the token it
  emits for the first drafted position is distributed as the target's softmax, chi-square);
* ``expected_calibration_error`` on hand-made cases.

Every target step of the loop runs at one padded shape (one compile), the reference greedy at
another; the shapes are shared by all tests.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from deepinfer_jax.checkpoint.random_checkpoint import write_random_checkpoint
from deepinfer_jax.config import preset
from deepinfer_jax.models.weights import load_model
from deepinfer_jax.runner.engram_hash import EngramHasher
from deepinfer_jax.runner.sequence_driver import SequenceDriver
from deepinfer_jax.runner.spec_acceptance import (acceptance_cache_config, expected_calibration_error,
                                                  measure_acceptance, verify_block)

PROMPT_LENS = (5, 19, 30)   # shorter and longer than the window (8): the rings wrap
NEW = 20
STEP = 32                   # tokens of every step: each prompt prefills in one chunk
R = len(PROMPT_LENS)
MAX_LEN = 64


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("v41_tiny_dspark")
    write_random_checkpoint(preset("v41-tiny"), d, seed=0, progress=False)
    model = load_model(d)
    assert model.cfg.sliding_window == 8 and model.cfg.dspark_block_size == 3
    hasher = EngramHasher.from_model_config(model.cfg, os.path.join(d, "tokenizer.json"))
    cc = acceptance_cache_config(model.cfg, R, MAX_LEN)
    return model, hasher, cc


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(7)
    return [rng.integers(3, 250, n).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def greedy(tiny, prompts):
    """The plain greedy continuation of each prompt (NEW + blk tokens, for the forced drafts)."""
    model, hasher, cc = tiny
    drv = SequenceDriver(model, cc, hasher)
    blk = model.cfg.dspark_block_size
    return [drv.generate_greedy(p, NEW + blk, slot=s, num_tokens=STEP, num_rows=R) for s, p in enumerate(prompts)]


def run(tiny, prompts, **kw):
    model, hasher, cc = tiny
    return measure_acceptance(model, prompts, NEW, hasher=hasher, cache_config=cc, step_tokens=STEP, **kw)


def force_drafts(monkeypatch, prompts, greedy, wrong: bool, vocab: int):
    """Replace the DSpark drafts by the greedy continuation (or by a token that never is it)."""
    orig = SequenceDriver.draft

    def draft(self, slots, input_ids, with_taps=False):
        ids, lg, conf, taps = orig(self, slots, input_ids, with_taps)
        ids = ids.copy()
        blk = ids.shape[1] - 1
        for r, s in enumerate(slots):
            i = s  # one group: prompt i runs in slot i
            hist = self.history[s]
            assert hist[:len(prompts[i])] == prompts[i]
            j = len(hist) + 1 - len(prompts[i])  # continuation index of the first draft's position
            want = np.asarray(greedy[i][j:j + blk])
            if len(want) < blk:  # a finished row (drafts ignored)
                want = np.resize(want if len(want) else np.zeros(1, np.int64), blk)
            ids[r, 1:] = (want + 1) % vocab if wrong else want
        return ids, lg, conf, taps

    monkeypatch.setattr(SequenceDriver, "draft", draft)


def test_greedy_tokens_are_the_plain_greedy_continuation(tiny, prompts, greedy):
    rep = run(tiny, prompts)
    blk = tiny[0].cfg.dspark_block_size
    for i, (got, want) in enumerate(zip(rep.tokens, greedy)):
        assert got == want[:NEW], f"prompt {i} (len {len(prompts[i])}): {got} != {want[:NEW]}"
    # bookkeeping: every verification recorded, tau consistent with the histogram
    h = np.asarray(rep.accepted_hist)
    assert len(h) == blk + 1 and h.sum() == rep.verifications > 0
    assert rep.pred_cum.shape == rep.obs_cum.shape == (rep.verifications, blk)
    assert np.all(np.diff(rep.pred_cum, axis=1) <= 0) and np.all((rep.pred_cum > 0) & (rep.pred_cum < 1))
    np.testing.assert_array_equal(rep.obs_cum.sum(1), np.repeat(np.arange(blk + 1), h))
    # tau is the histogram's mean of (accepted + 1)
    assert rep.tau == pytest.approx((h * (np.arange(blk + 1) + 1)).sum() / h.sum())
    # every token after the first comes from a verification; the last one may overshoot NEW
    assert rep.verifications <= R * (NEW - 1) <= (h * (np.arange(blk + 1) + 1)).sum()


def test_forced_right_drafts_accept_everything(tiny, prompts, greedy, monkeypatch):
    force_drafts(monkeypatch, prompts, greedy, wrong=False, vocab=tiny[0].cfg.vocab_size)
    rep = run(tiny, prompts)
    blk = tiny[0].cfg.dspark_block_size
    assert rep.tau == blk + 1
    assert rep.position_acceptance == [1.0] * blk
    assert rep.accepted_hist[:blk] == [0] * blk
    assert rep.tokens == [g[:NEW] for g in greedy]  # the kept verification cache is the commit


def test_forced_wrong_drafts_accept_nothing(tiny, prompts, greedy, monkeypatch):
    force_drafts(monkeypatch, prompts, greedy, wrong=True, vocab=tiny[0].cfg.vocab_size)
    rep = run(tiny, prompts)
    assert rep.tau == 1.0
    assert rep.position_acceptance[0] == 0.0
    assert rep.verifications == R * (NEW - 1)
    assert rep.tokens == [g[:NEW] for g in greedy]
    # the trace the simulator replays: one row per verification, nothing accepted
    t = rep.summary(trace=True)
    blk = tiny[0].cfg.dspark_block_size
    assert len(t["pred_cum"]) == len(t["obs_cum"]) == rep.verifications
    assert all(len(r) == blk and not any(r) for r in t["obs_cum"])
    assert "pred_cum" not in rep.summary()


def test_sampling_reproducible_with_a_seed(tiny, prompts):
    a = run(tiny, prompts, temperature=1.0, seed=5)
    b = run(tiny, prompts, temperature=1.0, seed=5)
    c = run(tiny, prompts, temperature=1.0, seed=6)
    assert a.tokens == b.tokens and a.accepted_hist == b.accepted_hist
    np.testing.assert_array_equal(a.pred_cum, b.pred_cum)
    assert a.tokens != c.tokens
    assert all(len(t) == NEW for t in a.tokens)


def _chi2_ok(counts: np.ndarray, probs: np.ndarray) -> tuple[float, float]:
    """(chi-square statistic, a generous threshold) over categories of expected count >= 5
    (the rest merged into one)."""
    n = counts.sum()
    exp = probs * n
    big = exp >= 5
    obs_c = np.append(counts[big], counts[~big].sum())
    exp_c = np.append(exp[big], exp[~big].sum())
    keep = exp_c > 0
    stat = float(((obs_c[keep] - exp_c[keep]) ** 2 / exp_c[keep]).sum())
    df = keep.sum() - 1
    return stat, df + 6 * np.sqrt(2 * df)  # ~ mean + 6 sd


@pytest.mark.parametrize("rank", [0, 3])  # the draft is the target's top token / its 4th
def test_rejection_sampling_is_lossless(rank):
    """The token the verification emits for the first drafted position (the draft when accepted,
    else the residual sample) follows the target softmax p_1, whatever the draft."""
    rng = np.random.default_rng(11)
    V, blk, T = 64, 3, 0.8
    logits = rng.normal(0, 1.5, (blk + 1, V))
    p1 = np.exp(logits[0] / T - (logits[0] / T).max())
    p1 /= p1.sum()
    d1 = int(np.argsort(-p1)[rank])
    drafts = [d1, int(rng.integers(V)), int(rng.integers(V))]
    n = 20000
    counts = np.zeros(V, np.int64)
    gen = np.random.default_rng(0)
    for _ in range(n):
        a, t = verify_block(logits, drafts, T, gen)
        counts[d1 if a >= 1 else t] += 1
    stat, thr = _chi2_ok(counts, p1)
    assert stat < thr, f"chi2 {stat:.1f} >= {thr:.1f}"
    # and the acceptance rate of d1 is p1(d1)
    assert abs(counts[d1] / n - p1[d1]) < 5 * np.sqrt(p1[d1] * (1 - p1[d1]) / n)


def test_verify_block_greedy_rule():
    V = 10
    lg = np.full((4, V), -1.0)
    for i, t in enumerate([3, 4, 5, 6]):
        lg[i, t] = 1.0
    assert verify_block(lg, [3, 4, 5]) == (3, 6)   # all accepted, bonus
    assert verify_block(lg, [3, 9, 5]) == (1, 4)   # correction at draft 2
    assert verify_block(lg, [0, 4, 5]) == (0, 3)


def test_expected_calibration_error():
    obs = np.array([1, 0, 0, 0, 1, 1, 1, 0], float)
    pred = np.array([0.25] * 4 + [0.75] * 4)
    assert expected_calibration_error(pred, obs) == pytest.approx(0.0)
    assert expected_calibration_error(pred + 0.1, obs) == pytest.approx(0.1)
    assert expected_calibration_error(pred - 0.2, obs) == pytest.approx(0.2)
    # weighting by bin size: 3 of 4 samples off by 0.5, 1 exact
    assert expected_calibration_error([0.5, 0.5, 0.5, 0.95], [0, 0, 0, 0.95], 10) == pytest.approx(0.375)
    assert np.isnan(expected_calibration_error([], []))
