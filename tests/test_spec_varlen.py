"""Host-side DSpark variable-length verification planning (``host_scheduler/spec_varlen.py``)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from deepinfer_jax.host_scheduler import spec_varlen as varlen
from deepinfer_jax.host_scheduler.spec_varlen import (
    ForwardRuntimeEstimator,
    SamplerRuntimeEstimator,
    TemperatureCalibrator,
    plan_varlen,
    plan_varlen_async,
    split_budget,
    step_sps,
    varlen_budget,
)


class Table:
    """SPS from a table (1-based tokens), recording which B were asked for."""

    def __init__(self, values):
        self.values = list(values)
        self.asked = []

    def __call__(self, b):
        self.asked.append(b)
        return self.values[b - 1]


class Spy:
    """[R, K] array wrapper recording the indices read."""

    def __init__(self, arr):
        self.arr = np.asarray(arr, dtype=np.float64)
        self.shape = self.arr.shape
        self.ndim = self.arr.ndim
        self.read = set()

    def __getitem__(self, idx):
        self.read.add(idx)
        return self.arr[idx]

    def __array__(self, dtype=None, copy=None):
        raise AssertionError("must not convert the whole array")


# ----------------------------------------------------------------------------- the brute force


def walk_order(a_RK):
    """All (r, j) (1-based j) with a > 0, in the walk's order: descending a, ties lower j, then lower r."""
    R, K = a_RK.shape
    pos = [(r, j) for r in range(R) for j in range(1, K + 1) if a_RK[r, j - 1] > 0]
    return sorted(pos, key=lambda p: (-a_RK[p[0], p[1] - 1], p[1], p[0]))


def brute_plan(conf_RK, sps, max_tokens=None):
    """Algorithm 1 written out: the explicit sorted walk and its stopping rule."""
    conf = np.asarray(conf_RK, dtype=np.float64)
    a = np.cumprod(conf, axis=1)
    R = conf.shape[0]
    lengths = np.zeros(R, dtype=np.int64)
    B, tau = R, float(R)
    best = tau * sps(B)
    for r, j in walk_order(a):
        if max_tokens is not None and B + 1 > max_tokens:
            break
        theta = (tau + a[r, j - 1]) * sps(B + 1)
        if not theta > best:
            break
        B, tau, best = B + 1, tau + a[r, j - 1], theta
        assert lengths[r] == j - 1  # prefix-closed: a row's positions come in order
        lengths[r] = j
    return lengths


def theta_of(a_RK, lengths, sps):
    R = a_RK.shape[0]
    tau = R + sum(a_RK[r, :l].sum() for r, l in enumerate(lengths))
    return tau * sps(R + int(sum(lengths)))


def random_instance(rng, discrete):
    R = int(rng.integers(1, 6))
    K = int(rng.integers(1, 6))
    if discrete:  # exact products: exercises ties
        conf = rng.choice([0.0, 0.25, 0.5, 0.75, 1.0], size=(R, K), p=[0.1, 0.2, 0.3, 0.2, 0.2])
    else:
        conf = rng.uniform(0, 1, size=(R, K)) ** rng.uniform(0.2, 2)
    n = R * (K + 1)
    # a decreasing SPS: a fixed cost plus a random non-negative per-token increment
    step = np.cumsum(np.concatenate([[rng.uniform(0.5, 2.0)], rng.exponential(rng.uniform(0.01, 0.5), n)]))
    sps_vals = 1.0 / step
    return conf, Table(sps_vals)


# ----------------------------------------------------------------------------- plan_varlen


def test_design_test_vector():
    """FEATURES.md section 4: SPS(1)=1.0, SPS(2)=0.5, SPS(3)=0.45, a_1 = 0.8 -> l = 0
    (theta_0 = 1.0 > theta_1 = 0.9), without reading c_2."""
    sps = Table([1.0, 0.5, 0.45])
    conf = Spy([[0.8, np.nan]])
    assert plan_varlen(conf, sps).tolist() == [0]
    assert (0, 1) not in conf.read
    assert conf.read == {(0, 0)}
    assert sps.asked == [1, 2]
    # a NaN in c_2 changes nothing
    assert plan_varlen(np.array([[0.8, np.nan]]), Table([1.0, 0.5, 0.45])).tolist() == [0]
    # with a flatter curve the first draft pays: theta_1 = 1.8 * 0.9 = 1.62 > 1.0, then c_2 is read
    conf = Spy([[0.8, 0.1]])
    assert plan_varlen(conf, Table([1.0, 0.9, 0.45])).tolist() == [1]
    assert conf.read == {(0, 0), (0, 1)}


def test_accepts_object_with_sps_and_cumulative_input():
    est = ForwardRuntimeEstimator([(1, 1.0), (2, 2.0), (3, 1 / 0.45)])
    assert plan_varlen([[0.8, 0.5]], est).tolist() == [0]
    conf = np.array([[0.9, 0.9, 0.5], [0.6, 0.2, 0.9]])
    sps = lambda b: 1.0 / (1.0 + 0.1 * b)
    assert (plan_varlen(np.cumprod(conf, 1), sps, cumulative=True).tolist()
            == plan_varlen(conf, sps).tolist())


def test_edge_cases():
    sps = lambda b: 1.0
    assert plan_varlen(np.zeros((0, 5)), sps).tolist() == []
    assert plan_varlen(np.zeros((3, 0)), sps).tolist() == [0, 0, 0]
    # constant SPS: every positive position improves theta, zero-confidence ones are never taken
    assert plan_varlen([[1.0, 0.5, 0.0, 1.0], [0.3, 0.3, 0.3, 0.3]], sps).tolist() == [2, 4]
    # ties: descending a, then lower j, then lower r (budget of one token at a time)
    conf = [[0.5, 1.0], [0.5, 1.0]]
    assert plan_varlen(conf, sps, max_tokens=3).tolist() == [1, 0]
    assert plan_varlen(conf, sps, max_tokens=4).tolist() == [1, 1]
    assert plan_varlen(conf, sps, max_tokens=5).tolist() == [2, 1]
    assert plan_varlen(conf, sps, max_tokens=1).tolist() == [0, 0]  # below R: no drafts
    with pytest.raises(ValueError):
        plan_varlen([0.5, 0.5], sps)
    with pytest.raises(TypeError):
        plan_varlen([[0.5]], 3.0)


@pytest.mark.parametrize("discrete", [False, True])
def test_matches_brute_force_walk(discrete):
    rng = np.random.default_rng(1 + discrete)
    for _ in range(400):
        conf, sps = random_instance(rng, discrete)
        max_tokens = None if rng.uniform() < 0.5 else int(rng.integers(0, conf.size + conf.shape[0] + 2))
        got = plan_varlen(conf, sps, max_tokens)
        want = brute_plan(conf, sps, max_tokens)
        assert got.tolist() == want.tolist(), (conf, sps.values, max_tokens)
        if max_tokens is not None:
            assert conf.shape[0] + got.sum() <= max(max_tokens, conf.shape[0])


@pytest.mark.parametrize("cumulative", [False, True])
def test_sorted_plan_equals_the_frontier_walk(cumulative):
    """A whole array is planned by one sort (``_plan_sorted``), a lazy array-like by the frontier
    walk; both give the same lengths, ties, zeros, token caps and, for cumulative input,
    survivals that rise along a row (the walk's guard flattens them) included."""
    rng = np.random.default_rng(11 + cumulative)
    sorted_used = 0
    for i in range(400):
        conf, sps = random_instance(rng, discrete=bool(i % 2))
        if cumulative:
            conf = np.cumprod(conf, axis=1) * rng.choice([1.0, 1.3], size=conf.shape, p=[0.8, 0.2])
        max_tokens = None if rng.uniform() < 0.5 else int(rng.integers(0, conf.size + conf.shape[0] + 2))
        sorted_used += varlen._sortable(conf, cumulative)
        got = plan_varlen(conf, sps, max_tokens, cumulative=cumulative)
        want = plan_varlen(Spy(conf), sps, max_tokens, cumulative=cumulative)
        assert got.tolist() == want.tolist(), (conf, sps.values, max_tokens)
    assert sorted_used == 400


def test_walk_prefixes_are_optimal_among_prefix_closed_choices():
    """For every choice of prefix-closed lengths, theta is at most the best theta over the walk's
    prefixes (the walk takes the largest a for each token count); the stopping rule finds that
    best whenever the walk's thetas are unimodal."""
    rng = np.random.default_rng(7)
    unimodal_seen = 0
    for _ in range(150):
        conf, sps = random_instance(rng, discrete=False)
        R, K = conf.shape
        if (K + 1) ** R > 5000:
            continue
        a = np.cumprod(conf, axis=1)
        best_all = max(theta_of(a, ls, sps) for ls in itertools.product(range(K + 1), repeat=R))
        # thetas along the full walk (no stopping)
        thetas, lengths = [theta_of(a, [0] * R, sps)], [0] * R
        for r, j in walk_order(a):
            lengths[r] = j
            thetas.append(theta_of(a, lengths, sps))
        assert max(thetas) >= best_all - 1e-12
        got = plan_varlen(conf, sps)
        assert theta_of(a, got, sps) <= best_all + 1e-12
        peak = int(np.argmax(thetas))
        if all(thetas[i] < thetas[i + 1] for i in range(peak)) and all(
                thetas[i] >= thetas[i + 1] for i in range(peak, len(thetas) - 1)):
            unimodal_seen += 1
            assert theta_of(a, got, sps) == pytest.approx(best_all, rel=1e-12)
    assert unimodal_seen > 20


def test_never_reads_past_the_stop():
    """Reads at most one confidence past the last taken position of each row (its frontier)."""
    rng = np.random.default_rng(3)
    for _ in range(100):
        conf, sps = random_instance(rng, discrete=False)
        spy = Spy(conf)
        got = plan_varlen(spy, sps)
        for (r, i) in spy.read:
            assert i <= got[r]  # 0-based index i is c_{r, i+1}


# ----------------------------------------------------------------------------- bucketed steps


def brute_plan_bucketed(conf_RK, sps, buckets, max_tokens=None):
    """The bucket rule written out: walk the whole order (up to the cap), then test the
    stopping rule at the prefixes whose token count is a bucket, and at the last prefix."""
    a = np.cumprod(np.asarray(conf_RK, dtype=np.float64), axis=1)
    R = a.shape[0]
    order = walk_order(a)
    if max_tokens is not None:
        order = order[:max(0, max_tokens - R)]
    taus = np.cumsum([float(R)] + [a[r, j - 1] for r, j in order])
    best, n = taus[0] * sps(R), 0
    for c in sorted({b - R for b in buckets if 0 < b - R < len(order)} | ({len(order)} if order else set())):
        theta = taus[c] * sps(R + c)
        if not theta > best:
            break
        best, n = theta, c
    lengths = np.zeros(R, dtype=np.int64)
    for r, j in order[:n]:
        lengths[r] = j
    return lengths


def bucketed_sps(rng, n):
    """Steps per second of a bucketed step: a random increasing bucket list; B runs at the
    smallest bucket holding it (the largest beyond), each bucket's time a random rise."""
    buckets = sorted(set(rng.integers(1, n + 2, size=int(rng.integers(1, 5))).tolist()))
    secs = np.cumsum(rng.uniform(0.5, 2.0) + rng.exponential(0.3, len(buckets)))
    return buckets, lambda B: 1.0 / secs[min(np.searchsorted(buckets, B), len(buckets) - 1)]


def test_bucketed_plan_fills_the_next_bucket_when_it_pays():
    """Four rows at bucket 4, the next bucket 24 costs 1.3x: the per-token rule stops at the first
    draft (4.9 / 1.3 < 4 tokens per unit time) and plans nothing, the bucket rule fills bucket 24
    (18.7 expected tokens / 1.3). When the drafts are poor, filling does not pay either."""
    sps = lambda B: 1.0 if B <= 4 else 1 / 1.3
    good = np.full((4, 5), 0.9)
    assert plan_varlen(good, sps).tolist() == [0, 0, 0, 0]
    assert plan_varlen(good, sps, buckets=(4, 24)).tolist() == [5, 5, 5, 5]
    assert plan_varlen(Spy(good), sps, buckets=(4, 24)).tolist() == [5, 5, 5, 5]
    poor = np.full((4, 5), 0.1)
    assert plan_varlen(poor, sps, buckets=(4, 24)).tolist() == [0, 0, 0, 0]
    # a cap inside the bucket: the walk's end (12 tokens) is the candidate
    assert plan_varlen(good, sps, max_tokens=12, buckets=(4, 24)).tolist() == [2, 2, 2, 2]
    # one bucket per token count is the per-token rule
    assert plan_varlen(good, sps, buckets=range(1, 25)).tolist() == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="buckets must be positive"):
        plan_varlen(good, sps, buckets=(0, 24))


@pytest.mark.parametrize("discrete", [False, True])
def test_bucketed_plan_matches_brute_force(discrete):
    """Sorted and frontier-walk plans equal the written-out bucket rule on random instances,
    bucket lists and token caps; with every token count a bucket they equal the plain rule."""
    rng = np.random.default_rng(21 + discrete)
    filled = 0
    for _ in range(400):
        conf, table = random_instance(rng, discrete)
        R, K = conf.shape
        buckets, sps = bucketed_sps(rng, R * (K + 1))
        max_tokens = None if rng.uniform() < 0.5 else int(rng.integers(0, conf.size + R + 2))
        want = brute_plan_bucketed(conf, sps, buckets, max_tokens)
        assert plan_varlen(conf, sps, max_tokens, buckets=buckets).tolist() == want.tolist()
        assert plan_varlen(Spy(conf), sps, max_tokens, buckets=buckets).tolist() == want.tolist()
        filled += int(want.sum() > plan_varlen(conf, sps, max_tokens).sum())
        every = range(1, R * (K + 1) + 1)
        assert (plan_varlen(conf, table, max_tokens, buckets=every).tolist()
                == plan_varlen(conf, table, max_tokens).tolist())
    assert filled >= 10  # instances where the bucket rule plans more than the per-token rule


# ----------------------------------------------------------------------------- the async variant


def test_async_budget_from_old_split_by_current():
    sps = lambda b: 1.0 / (1.0 + 0.25 * b)
    old = np.array([[0.9, 0.9, 0.9], [0.9, 0.9, 0.2]])
    k_total = varlen_budget(old, sps)
    assert k_total == plan_varlen(old, sps).sum() > 0
    cur = np.array([[0.1, 0.9, 0.9], [0.99, 0.99, 0.99]])
    got = plan_varlen_async(cur, old, sps)
    assert got.sum() == k_total
    assert got.tolist() == split_budget(cur, k_total).tolist()
    assert got[1] >= got[0]  # the current confidences decide who gets the budget
    assert plan_varlen_async(cur, 2, sps).tolist() == [0, 2]  # an int budget directly
    assert plan_varlen_async(cur, 10, sps, max_tokens=4).sum() == 2  # capped by max_tokens - R
    # different row counts: the budget is scaled by R / Q
    assert plan_varlen_async(np.tile(cur, (2, 1)), old, sps).sum() == min(2 * k_total, 12)


def test_async_split_matches_walk_order():
    rng = np.random.default_rng(5)
    for _ in range(200):
        conf, _ = random_instance(rng, discrete=True)
        a = np.cumprod(conf, 1)
        order = walk_order(a)
        k = int(rng.integers(0, conf.size + 2))
        want = np.zeros(conf.shape[0], dtype=np.int64)
        for r, j in order[:k]:
            want[r] = j
        assert split_budget(conf, k).tolist() == want.tolist()
        assert split_budget(conf, k).sum() == min(k, len(order))


def test_async_later_positions_never_influence_earlier():
    """Changing c_{r,i} (i > j) never changes whether (r, j) is verified, in the async split and
    in Algorithm 1; the async step's token count does not depend on the current values."""
    rng = np.random.default_rng(11)
    for _ in range(300):
        conf, sps = random_instance(rng, discrete=bool(rng.integers(0, 2)))
        R, K = conf.shape
        if K < 2:
            continue
        old = rng.uniform(0, 1, size=(R, K))
        r, i = int(rng.integers(0, R)), int(rng.integers(1, K))  # 0-based i >= 1: a later position
        changed = conf.copy()
        changed[r, i] = rng.choice([0.0, 1.0, rng.uniform()])
        for plan in (lambda c: plan_varlen_async(c, old, sps), lambda c: plan_varlen(c, sps)):
            before, after = plan(conf), plan(changed)
            # positions 1..i of row r (0-based < i) keep their verdicts
            assert min(before[r], i) == min(after[r], i)
        n_pos = lambda c: int((np.cumprod(c, 1) > 0).sum())
        k_total = varlen_budget(old, sps)
        assert plan_varlen_async(conf, old, sps).sum() == min(k_total, n_pos(conf))
        assert plan_varlen_async(changed, old, sps).sum() == min(k_total, n_pos(changed))


# ----------------------------------------------------------------------------- runtime estimators


def test_forward_estimator_curve_and_extrapolation():
    est = ForwardRuntimeEstimator([(64, 0.010), (16, 0.008), (256, 0.020)])
    assert est.seconds(16) == pytest.approx(0.008)
    assert est.seconds(40) == pytest.approx(0.009)
    assert est.seconds(160) == pytest.approx(0.015)
    assert est.seconds(448) == pytest.approx(0.030)  # linear beyond the last point
    assert est.seconds(4) == pytest.approx(0.0075)  # and below the first
    assert est.seconds(-10_000) == pytest.approx(est.min_seconds)
    assert est.sps(64) == pytest.approx(100.0)
    assert est(64) == est.sps(64)
    assert ForwardRuntimeEstimator([(32, 0.01)]).seconds(1000) == pytest.approx(0.01)
    with pytest.raises(ValueError):
        ForwardRuntimeEstimator([])
    with pytest.raises(ValueError):
        ForwardRuntimeEstimator([(1, 0.1), (1, 0.2)])


def test_forward_estimator_online_correction():
    est = ForwardRuntimeEstimator([(16, 0.008), (64, 0.010), (256, 0.020)], alpha=0.5, min_obs=2)
    est.observe(64, 0.020)  # ratio 2 at bucket 64; the bucket has too few, the global ratio applies
    assert est.seconds(64) == pytest.approx(0.020)
    assert est.seconds(256) == pytest.approx(0.040)
    est.observe(70, 0.010 * (1 + 6 / 192 * 1) * 2)  # bucket 64 again, ratio 2
    assert est.seconds(64) == pytest.approx(0.020)
    for _ in range(30):
        est.observe(256, 0.020)  # ratio 1 at bucket 256: converges there
    assert est.seconds(256) == pytest.approx(0.020, rel=1e-6)
    assert est.seconds(64) == pytest.approx(0.020)  # bucket 64 keeps its own ratio
    assert est.seconds(16) == pytest.approx(0.008, rel=1e-6)  # no data: the global ratio (~1 now)
    est.observe(64, float("nan"))  # ignored
    assert est.seconds(64) == pytest.approx(0.020)
    assert est.base(64) == pytest.approx(0.010)


def test_forward_estimator_one_outlier_moves_it_at_most_max_jump():
    """A single step 10x the curve (a compile, a pause) doubles the estimate at most; ordinary
    steps then bring it back."""
    est = ForwardRuntimeEstimator([(16, 0.01), (64, 0.02)], alpha=0.5, min_obs=1)
    est.observe(16, 0.10)
    assert est.seconds(16) == pytest.approx(0.02)
    for _ in range(12):
        est.observe(16, 0.01)
    assert est.seconds(16) == pytest.approx(0.01, rel=1e-3)
    with pytest.raises(ValueError, match="max_jump"):
        ForwardRuntimeEstimator([(16, 0.01)], max_jump=1.0)


def test_sampler_estimator():
    est = SamplerRuntimeEstimator(window=4, min_samples=3, default=0.5)
    assert est.seconds(8) == 0.5
    est.observe(8, 1.0)
    est.observe(8, 3.0)
    assert est.seconds(8) == pytest.approx(2.0)  # too few for key 8: the global median
    est.observe(8, 2.5)
    assert est.seconds(8) == pytest.approx(2.5)  # key median
    for s in (10.0, 10.0, 10.0):
        est.observe(16, s)
    assert est.seconds(16) == 10.0
    assert est.seconds(4) == pytest.approx(10.0)  # global window holds the last 4: 2.5, 10, 10, 10
    for s in (1.0, 1.0, 1.0, 1.0):
        est.observe(8, s)
    assert est.seconds(8) == 1.0  # sliding window per key
    fwd = ForwardRuntimeEstimator([(1, 1.0), (10, 1.0)])
    assert step_sps(fwd, est, 8)(5) == pytest.approx(0.5)
    assert step_sps(fwd)(5) == pytest.approx(1.0)


# ----------------------------------------------------------------------------- calibration


def test_temperature_calibration_recovers_temperature():
    rng = np.random.default_rng(0)
    N, K = 20000, 3
    true_T = np.array([2.0, 0.5, 1.0])
    z = rng.normal(0, 3, size=(N, K))
    y = (rng.uniform(size=(N, K)) < 1 / (1 + np.exp(-z / true_T))).astype(float)
    mask = np.ones((N, K), bool)
    mask[: N // 2, 2] = False
    cal = TemperatureCalibrator(K).fit(z, y, mask)
    np.testing.assert_allclose(cal.temperature_K, true_T, rtol=0.08)
    # the fit minimises the BCE: nearby temperatures are no better
    for k in range(K):
        b = 1 / cal.temperature_K[k]
        sel = mask[:, k]
        f = lambda bb: TemperatureCalibrator.bce(bb, z[sel, k], y[sel, k])
        assert f(b) <= min(f(b * 1.05), f(b / 1.05))
    p = cal.calibrate(z[:4])
    np.testing.assert_allclose(p, 1 / (1 + np.exp(-z[:4] / cal.temperature_K)))
    # too few pairs: temperature stays 1
    assert TemperatureCalibrator(2, min_pairs=50).fit(z[:10, :2], y[:10, :2]).temperature_K.tolist() == [1, 1]


def test_online_calibration_from_verified_rows():
    """Rows from a head twice too confident at position 0 and well calibrated after: each row's
    acceptance follows the true conditional probabilities up to the first rejection. The online
    calibrator sees only (logits, drafts, accepted) per row, learns T ~ (2, 1, 1) from the
    positions each row reached, refits on its cadence and forgets rows beyond its window."""
    from deepinfer_jax.host_scheduler.spec_calibration import OnlineTemperatureCalibrator

    rng = np.random.default_rng(1)
    K, N = 3, 12000
    true_T = np.array([2.0, 1.0, 1.0])
    cal = OnlineTemperatureCalibrator(K, window=N, refit_every=1000)
    np.testing.assert_array_equal(cal.probabilities(np.zeros((1, K))), 0.5)  # raw sigmoid before a fit
    for i in range(N):
        z = rng.normal(0, 3, size=K)
        n = int(rng.integers(1, K + 1))  # varlen: rows verify 1..K drafts
        ok = rng.uniform(size=K) < 1 / (1 + np.exp(-z / true_T))
        a = int(np.argmin(np.r_[ok[:n], False]))  # accepted until the first rejection
        cal.observe(z, n, a)
    assert cal.observed == N and cal.fits == N // 1000
    np.testing.assert_allclose(cal.temperature_K, true_T, rtol=0.12)
    p = cal.probabilities(np.array([[2.0, 2.0, 2.0]]))
    np.testing.assert_allclose(p, 1 / (1 + np.exp(-2.0 / cal.temperature_K))[None])
    cal.observe([1.0], 0, 0)  # a row without drafts carries nothing
    assert cal.observed == N
    with pytest.raises(ValueError, match="num_accepted=3, num_drafts=2"):
        cal.observe([0, 0], 2, 3)
    with pytest.raises(ValueError, match="window=0"):
        OnlineTemperatureCalibrator(K, window=0)


# ----------------------------------------------------------------------------- in the scheduler


def _decoding_scheduler(waiting_prompt: int):
    """A varlen scheduler (3 drafts, 64-token budget) with 4 decoding requests whose drafts are
    all confident, and a waiting prompt of ``waiting_prompt`` tokens (0: none)."""
    from deepinfer_jax.config import preset
    from deepinfer_jax.engine_config import EngineConfig
    from deepinfer_jax.host_scheduler.request import Request
    from deepinfer_jax.host_scheduler.scheduler import Scheduler
    from deepinfer_jax.sampling.params import SamplingParams

    cfg = preset("v41-tiny")
    ec = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, token_buckets=(64,), precompile=False,
                      spec_decode="dspark", num_draft_tokens=3, spec_varlen=True).resolve(cfg)
    sch = Scheduler(ec)
    sch.spec_sps = lambda B: 1.0  # a flat step cost: every confident draft pays
    p = SamplingParams(max_tokens=32, ignore_eos=True).validate()
    for i in range(4):
        r = Request(f"d{i}", list(range(1, 11)), p, seed=i, output_token_ids=[7])
        r.num_computed = r.num_tokens - 1  # decoding: the newest token is the row's input
        r.draft_token_ids, r.draft_confidence = [3, 3, 3], [4.0, 4.0, 4.0]  # sigmoid 0.98
        sch.running.append(r)
    if waiting_prompt:
        sch.waiting.append(Request("w", list(range(1, waiting_prompt + 1)), p, seed=9))
    return sch


def test_scheduler_varlen_leaves_the_budget_to_prompts():
    """Decode rows get their drafts from the budget prompt tokens leave: with nothing waiting all
    four rows verify 3 drafts; with a 58-token prompt waiting (64 - 4 rows = 60 free) only 2
    drafts fit; with a prompt of the whole budget, none."""
    assert sorted(_decoding_scheduler(0)._plan_drafts(64)[0].values()) == [3, 3, 3, 3]
    assert sum(_decoding_scheduler(58)._plan_drafts(64)[0].values()) == 2
    assert _decoding_scheduler(64)._plan_drafts(64) == ({}, False)  # no switch: never plain
    assert _decoding_scheduler(64)._prefill_demand(64) == 64
