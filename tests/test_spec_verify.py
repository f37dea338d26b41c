"""The device-side verifier of speculative drafts (``sampling.spec_verify.verify_drafts``): the
greedy rule, the ``sample`` identity of ``l = 0`` rows, losslessness (chi-square),
reproducibility, the bitmask, and agreement with the host reference ``verify_block``."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from deepinfer_jax.runner.spec_acceptance import verify_block
from deepinfer_jax.sampling import SamplingParams, SpecVerifyOutput, build_sampling_batch, sample, verify_drafts

RNG = np.random.default_rng(41)
RULES = ("uniform", "coupled")

# chi-square critical values at alpha = 1e-3 (scipy.stats.chi2.ppf(1 - 1e-3, dof)), by dof: each
# chi-square test below has a false-alarm rate of 1e-3 for a correct verifier (the 8 tests
# together at most 8e-3); the seeds are a fixed range, so every run draws the same samples
# (the test is deterministic: it passes or fails the same way every time).
CHI2_CRIT_1E3 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322,
                 8: 26.124, 9: 27.877, 10: 29.588, 11: 31.264, 12: 32.909, 13: 34.528, 14: 36.123,
                 15: 37.697, 16: 39.252, 17: 40.79, 18: 42.312, 19: 43.82, 20: 45.315, 21: 46.797,
                 22: 48.268, 23: 49.728, 24: 51.179, 25: 52.62, 26: 54.052, 27: 55.476, 28: 56.892,
                 29: 58.301, 30: 59.703, 31: 61.098, 32: 62.487, 33: 63.87, 34: 65.247, 35: 66.619,
                 36: 67.985, 37: 69.346, 38: 70.703, 39: 72.055, 40: 73.402}


def run(logits, drafts, nums, rows, allowed=None, num_logprobs=0, rule="uniform", **kw) -> SpecVerifyOutput:
    logits = np.asarray(logits, np.float32)
    sb = build_sampling_batch(rows, logits.shape[0], logits.shape[-1], **kw)
    out = verify_drafts(logits, np.asarray(drafts, np.int32), np.asarray(nums, np.int32), sb,
                      allowed, num_logprobs=num_logprobs, rule=rule)
    return jax.tree.map(np.asarray, out)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


GREEDY = SamplingParams(temperature=0.0)


# --------------------------------------------------------------------------- greedy


def test_greedy_hand_made():
    V, K = 8, 3
    lg = np.zeros((K + 1, V), np.float32)
    for i, t in enumerate([3, 4, 5, 6]):  # argmax per slot
        lg[i, t] = 2.0
        lg[i, (t + 1) % V] = 1.0          # second best
    cases = [  # drafts, l, accepted, tokens
        ([3, 4, 5], 3, 3, [3, 4, 5, 6]),      # all accepted + bonus
        ([3, 4, 0], 3, 2, [3, 4, 5, -1]),     # correction at draft 3
        ([3, 1, 5], 3, 1, [3, 4, -1, -1]),    # correction at draft 2 (later match ignored)
        ([0, 4, 5], 3, 0, [3, -1, -1, -1]),   # correction at draft 1
        ([3, 4, 0], 2, 2, [3, 4, 5, -1]),     # l = 2: bonus from slot 2, draft 3 ignored
        ([3, 0, 0], 1, 1, [3, 4, -1, -1]),    # l = 1: bonus
        ([0, 0, 0], 0, 0, [3, -1, -1, -1]),   # l = 0: plain greedy
    ]
    R = len(cases)
    out = run(np.broadcast_to(lg, (R, K + 1, V)), [c[0] for c in cases], [c[1] for c in cases],
              [(GREEDY, 0, 10)] * R, num_logprobs=2)
    assert out.num_accepted.tolist() == [c[2] for c in cases]
    assert out.num_emitted.tolist() == [c[2] + 1 for c in cases]
    assert out.token_ids.tolist() == [c[3] for c in cases]
    ref_lp = log_softmax(lg)
    for r, c in enumerate(cases):
        for i, t in enumerate(c[3]):
            want = ref_lp[i, t] if t >= 0 else 0.0
            assert out.logprob[r, i] == pytest.approx(want, abs=1e-6)
    assert out.top_ids.shape == (R, K + 1, 2) and out.top_ids[0, :, 0].tolist() == [3, 4, 5, 6]


def test_greedy_ties_bans_and_per_slot_bans():
    V, K = 6, 2
    lg = np.zeros((2, K + 1, V), np.float32)
    lg[:, 0, [1, 4]] = 5.0   # tie at slot 0 -> id 1
    lg[:, 1, 2] = 3.0
    lg[:, 1, 0] = 2.0
    lg[:, 2, 5] = 1.0
    out = run(lg, [[1, 2], [4, 2]], [2, 2], [(GREEDY, 0, 0), (GREEDY, 0, 0, [1])])
    assert out.token_ids.tolist() == [[1, 2, 5], [4, 2, 5]]  # row 1: 1 banned, so 4 is the argmax
    # per-slot bans [R, K+1, B]: ban 2 at slot 1 only -> the correction there is 0
    sb = build_sampling_batch([(GREEDY, 0, 0)] * 2, 2, V)
    banned = np.full((2, K + 1, 1), -1, np.int32)
    banned[:, 1, 0] = 2
    sb.banned_RB = banned
    out = jax.tree.map(np.asarray, verify_drafts(lg, np.array([[1, 2], [1, 0]], np.int32), np.array([2, 2]), sb))
    assert out.token_ids.tolist() == [[1, 0, -1], [1, 0, 5]]


@pytest.mark.parametrize("K", [1, 4])
def test_greedy_agrees_with_verify_block(K):
    R, V = 64, 50
    logits = RNG.standard_normal((R, K + 1, V)).astype(np.float32) * 2
    am = logits.argmax(-1)
    drafts = np.zeros((R, K), np.int32)
    nums = RNG.integers(0, K + 1, R)
    for r in range(R):
        cut = RNG.integers(0, K + 1)  # drafts match the argmax before cut, then a miss
        for i in range(K):
            drafts[r, i] = am[r, i] if i < cut else (am[r, i] + 1 + RNG.integers(0, V - 1)) % V
    out = run(logits, drafts, nums, [(GREEDY, r, 5)] * R)
    for r in range(R):
        l = int(nums[r])
        a, t = verify_block(logits[r, :l + 1], drafts[r, :l], 0.0)
        assert out.num_accepted[r] == a
        assert out.token_ids[r].tolist() == drafts[r, :a].tolist() + [t] + [-1] * (K - a)


# --------------------------------------------------------------------------- l = 0 is `sample`


SAMPLED_ROWS = [
    (GREEDY, 3, 17),
    (SamplingParams(temperature=0.8, seed=1), 1, 5),
    (SamplingParams(temperature=1.0, top_k=7), 2**40 + 5, 123),
    (SamplingParams(temperature=0.6, top_p=0.8), 77, 0),
    (SamplingParams(temperature=1.3, min_p=0.1, top_k=20, top_p=0.95), 9, 2**20),
    (SamplingParams(temperature=0.9), 11, 40, [0, 5, 6]),
    (GREEDY, 0, 3, [2]),
    (SamplingParams(temperature=0.7, top_p=0.9), 2**63 + 12345, 999),
]


@pytest.mark.parametrize("rule", RULES)
def test_l0_rows_equal_sample(rule):
    R, K, V = len(SAMPLED_ROWS), 3, 100
    logits = RNG.standard_normal((R, K + 1, V)).astype(np.float32) * 3
    drafts = RNG.integers(0, V, (R, K))
    nums = np.array([0, 0, 2, 0, 3, 0, 1, 0])  # l = 0 rows mixed with rows that verify drafts
    out = run(logits, drafts, nums, SAMPLED_ROWS, num_logprobs=4, rule=rule)
    sb = build_sampling_batch(SAMPLED_ROWS, R, V)
    ref = jax.tree.map(np.asarray, sample(logits[:, 0], sb, num_logprobs=4))
    for r in np.flatnonzero(nums == 0):
        assert out.num_accepted[r] == 0 and out.num_emitted[r] == 1
        assert out.token_ids[r, 0] == ref.token_ids[r] and (out.token_ids[r, 1:] == -1).all()
        assert out.logprob[r, 0].tobytes() == ref.logprob[r].tobytes()  # bit for bit
        assert (out.top_ids[r, 0] == ref.top_ids[r]).all()
        assert out.top_logprobs[r, 0].tobytes() == ref.top_logprobs[r].tobytes()
    # all-greedy batches take the static greedy path
    greedy_rows = [(GREEDY, 0, 4)] * 3
    out = run(logits[:3], drafts[:3], [0, 0, 0], greedy_rows, rule=rule)
    assert out.token_ids[:, 0].tolist() == logits[:3, 0].argmax(-1).tolist()


def test_coupled_rule_emits_what_sample_draws():
    """With ``rule="coupled"`` every emitted slot holds the token ``sample`` draws at that (seed,
    position): speculation does not change a seeded request's output."""
    R, K, V = len(SAMPLED_ROWS), 3, 30
    logits = RNG.standard_normal((R, K + 1, V)).astype(np.float32)
    sb = build_sampling_batch(SAMPLED_ROWS, R, V)
    per_slot = []
    for i in range(K + 1):
        rows_i = [(p, s, pos + i, *rest) for p, s, pos, *rest in SAMPLED_ROWS]
        per_slot.append(np.asarray(sample(logits[:, i], build_sampling_batch(rows_i, R, V)).token_ids))
    per_slot = np.stack(per_slot, 1)
    drafts = per_slot[:, :K].copy()
    drafts[::3, 1] = (drafts[::3, 1] + 1) % V  # some misses
    out = jax.tree.map(np.asarray, verify_drafts(logits, drafts, np.full(R, K), sb, rule="coupled"))
    for r in range(R):
        a = out.num_accepted[r]
        assert (out.token_ids[r, :a + 1] == per_slot[r, :a + 1]).all()
    assert (out.num_accepted[::3] <= 1).all() and (out.num_accepted[1::3] == K).all()


# --------------------------------------------------------------------------- losslessness


V_SMALL = 12
LOGITS_1 = np.array([0.3, 2.0, -1.0, 1.6, 0.9, -2.5, 1.2, -0.4, 0.5, -3.0, 0.0, -1.6], np.float32)
LOGITS_2 = np.array([1.0, -0.5, 0.2, -2.0, 1.8, 0.4, -1.2, 1.4, -3.0, 0.7, -0.1, 0.0], np.float32)
TEMP, TOP_P = 0.7, 0.9
PARAMS = SamplingParams(temperature=TEMP, top_p=TOP_P)


def target_probs(logits: np.ndarray) -> np.ndarray:
    """The sampler's p after temperature and top-p, in float64 (vLLM's rule: drop the tokens whose
    own mass plus the mass of every lower token is <= 1 - top_p; the top token stays)."""
    z = logits.astype(np.float64) / TEMP
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(p)  # ascending
    tail = np.cumsum(p[order])
    keep = np.zeros(len(p), bool)
    keep[order] = tail > 1 - TOP_P
    keep[order[-1]] = True
    q = np.where(keep, p, 0.0)
    return q / q.sum()


def chi2_check(counts: np.ndarray, probs: np.ndarray) -> None:
    """Pearson chi-square goodness of fit over the support of ``probs`` (alpha = 1e-3); a count
    outside the support fails outright."""
    counts, probs = counts.ravel(), probs.ravel()
    support = probs > 0
    assert counts[~support].sum() == 0, "a token of probability 0 was emitted"
    n = counts.sum()
    expected = n * probs[support]
    assert expected.min() >= 5, "too few samples per cell for the chi-square approximation"
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    dof = int(support.sum()) - 1
    assert stat < CHI2_CRIT_1E3[dof], f"chi2={stat:.2f} >= {CHI2_CRIT_1E3[dof]} (dof={dof})"


def test_target_probs_match_the_sampler_filter():
    from deepinfer_jax.sampling.sampler import apply_filters
    f = np.asarray(apply_filters(LOGITS_1[None] / TEMP, np.zeros(1, np.int32), np.full(1, TOP_P, np.float32),
                                 np.zeros(1, np.float32)))[0]
    assert ((f > -np.inf) == (target_probs(LOGITS_1) > 0)).all()


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("which", ["top", "low", "disallowed"])
def test_first_token_is_lossless(rule, which):
    """Whatever the draft, the first emitted token follows p_1 (l = 1; seeds 0..N-1 at one
    position, a fixed range, so the test is deterministic)."""
    p1 = target_probs(LOGITS_1)
    support = np.flatnonzero(p1 > 0)
    assert 4 <= len(support) < V_SMALL  # the top-p cut removes some tokens
    draft = {"top": int(p1.argmax()), "low": int(support[p1[support].argmin()]),
             "disallowed": int(np.flatnonzero(p1 == 0)[0])}[which]
    N = 20000
    logits = np.broadcast_to(np.stack([LOGITS_1, LOGITS_2]), (N, 2, V_SMALL))
    out = run(logits, np.full((N, 1), draft), np.ones(N), [(PARAMS, s, 31) for s in range(N)], rule=rule)
    chi2_check(np.bincount(out.token_ids[:, 0], minlength=V_SMALL), p1)
    acc = out.num_accepted.mean()
    assert abs(acc - p1[draft]) < 4 * np.sqrt(max(p1[draft], 1e-9) / N) + 1e-9  # accepted w.p. p_1(d)
    if which == "disallowed":
        assert (out.num_accepted == 0).all()


@pytest.mark.parametrize("rule", RULES)
def test_first_two_tokens_are_lossless(rule):
    """Joint law of the first two emitted tokens with l = 2 against p_1(x) p_2(y | x).
    Simplification: the target logits at position 2 do not depend on x (the same LOGITS_2 row),
    so p_2(y | x) = p_2(y). A row that emits one token (draft 1 rejected) gets its second token
    from the next round: a verification with l = 0 at the next position, as the engine would do."""
    p1, p2 = target_probs(LOGITS_1), target_probs(LOGITS_2)
    s2 = np.flatnonzero(p2 > 0)
    d1, d2 = int(p1.argmax()), int(s2[np.argsort(p2[s2])[len(s2) // 2]])  # top of p_1, a middle token of p_2
    N = 40000
    logits = np.broadcast_to(np.stack([LOGITS_1, LOGITS_2, LOGITS_1]), (N, 3, V_SMALL))
    rows = [(PARAMS, 10**6 + s, 50) for s in range(N)]
    out = run(logits, np.tile([d1, d2], (N, 1)), np.full(N, 2), rows, rule=rule)
    first = out.token_ids[:, 0]
    second = out.token_ids[:, 1].copy()
    again = np.flatnonzero(out.num_emitted == 1)
    nxt = run(np.broadcast_to(LOGITS_2, (len(again), 1, V_SMALL)), np.zeros((len(again), 0)),
              np.zeros(len(again)), [(PARAMS, 10**6 + s, 51) for s in again], rule=rule)
    second[again] = nxt.token_ids[:, 0]
    assert 0 < len(again) < N and (out.num_accepted == 2).any()
    counts = np.zeros((V_SMALL, V_SMALL), np.int64)
    np.add.at(counts, (first, second), 1)
    chi2_check(counts, np.outer(p1, p2))


# --------------------------------------------------------------------------- reproducibility


@pytest.mark.parametrize("rule", RULES)
def test_rows_independent_of_batch(rule):
    R, K, V = len(SAMPLED_ROWS), 3, 40
    logits = (RNG.standard_normal((R, K + 1, V)) * 1.5).astype(np.float32)
    # drafts = the target's argmax mostly (so that some are accepted), else random
    drafts = np.where(RNG.random((R, K)) < 0.7, logits[:, :K].argmax(-1), RNG.integers(0, V, (R, K)))
    nums = np.array([3, 2, 3, 1, 0, 3, 2, 3])
    base = run(logits, drafts, nums, SAMPLED_ROWS, num_logprobs=2, rule=rule)
    assert (base.num_accepted > 0).any()

    def same(out, rows_out, rows_base, K_out=K):
        for i, j in zip(rows_out, rows_base):
            assert out.num_accepted[i] == base.num_accepted[j]
            assert (out.token_ids[i, :K + 1] == base.token_ids[j]).all() and (out.token_ids[i, K + 1:] == -1).all()
            assert out.logprob[i, :K + 1].tobytes() == base.logprob[j].tobytes()

    perm = RNG.permutation(R)
    out = run(logits[perm], drafts[perm], nums[perm], [SAMPLED_ROWS[p] for p in perm], num_logprobs=2, rule=rule)
    same(out, range(R), perm)
    # more rows, and more draft slots of padding (K = 5)
    Kp, extra = 5, 5
    lp = (RNG.standard_normal((R + extra, Kp + 1, V)) * 1.5).astype(np.float32)
    dp = RNG.integers(0, V, (R + extra, Kp))
    order = np.r_[np.arange(extra) + R, RNG.permutation(R)]  # new rows first
    rows = [(SamplingParams(temperature=1.0), 5 + e, 3) for e in range(extra)]
    for k, j in enumerate(order[extra:]):
        lp[extra + k, :K + 1] = logits[j]
        dp[extra + k, :K] = drafts[j]
        rows.append(SAMPLED_ROWS[j])
    numsp = np.r_[RNG.integers(0, Kp + 1, extra), nums[order[extra:]]]
    out = run(lp, dp, numsp, rows, num_logprobs=2, rule=rule, num_banned=8)
    same(out, range(extra, R + extra), order[extra:])
    # and the same call twice
    again = run(lp, dp, numsp, rows, num_logprobs=2, rule=rule, num_banned=8)
    assert all((np.asarray(a) == np.asarray(b)).all() for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(again)))


# --------------------------------------------------------------------------- bitmask


def pack(allowed_XV: np.ndarray) -> np.ndarray:
    *lead, V = allowed_XV.shape
    W = -(-V // 32)
    bits = np.zeros((*lead, W * 32), bool)
    bits[..., :V] = allowed_XV
    words = (bits.reshape(*lead, W, 32).astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(-1)
    return words.astype(np.uint32).view(np.int32)


@pytest.mark.parametrize("rule", RULES)
def test_bitmask(rule):
    R, K, V = 600, 2, 40  # V not a multiple of 32: two words, the second partly used
    logits = (RNG.standard_normal((R, K + 1, V)) * 2).astype(np.float32)
    allowed = RNG.random((R, K + 1, V)) < 0.4
    allowed[..., 33] = True  # a token in the second word, so no slot is fully masked
    params = [GREEDY, SamplingParams(temperature=1.0), SamplingParams(temperature=0.5, top_k=5)]
    rows = [(params[r % 3], r, 7) for r in range(R)]
    masked = np.where(allowed, logits, -np.inf)
    # drafts: the masked argmax (should pass for greedy rows), or a disallowed token
    drafts = masked[:, :K].argmax(-1)
    bad = RNG.random((R, K)) < 0.5
    disallowed_tok = np.argmax(~allowed[:, :K], axis=-1)
    drafts = np.where(bad, disallowed_tok, drafts)
    assert not allowed[:, :K][bad[..., None] & (np.arange(V) == disallowed_tok[..., None])].any()
    out = run(logits, drafts, np.full(R, K), rows, allowed=pack(allowed), rule=rule)
    for r in range(R):
        a = out.num_accepted[r]
        assert not bad[r, :a].any(), "a disallowed draft was accepted"
        for i, t in enumerate(out.token_ids[r, :a + 1]):
            assert allowed[r, i, t], "an emitted token is outside the allowed set"
    # greedy rows accept the masked argmax up to the first disallowed draft
    g = np.arange(0, R, 3)
    want = np.where(bad[g].any(-1), bad[g].argmax(-1), K)
    assert (out.num_accepted[g] == want).all()
    # no mask == an all-ones mask
    full = run(logits, drafts, np.full(R, K), rows, allowed=pack(np.ones_like(allowed)), rule=rule)
    none = run(logits, drafts, np.full(R, K), rows, rule=rule)
    assert (full.token_ids == none.token_ids).all()


def test_shape_errors():
    sb = build_sampling_batch([(GREEDY, 0, 0)], 1, 8)
    with pytest.raises(ValueError, match="draft_RK"):
        verify_drafts(np.zeros((1, 3, 8), np.float32), np.zeros((1, 3), np.int32), np.zeros(1, np.int32), sb)
    with pytest.raises(ValueError, match="allowed_RKW"):
        verify_drafts(np.zeros((1, 3, 8), np.float32), np.zeros((1, 2), np.int32), np.zeros(1, np.int32), sb,
                    np.zeros((1, 3, 2), np.int32))
    with pytest.raises(ValueError, match="rule"):
        verify_drafts(np.zeros((1, 3, 8), np.float32), np.zeros((1, 2), np.int32), np.zeros(1, np.int32), sb,
                    rule="typical")
