"""DSpark variable-length verification: host-side planning (plain Python/NumPy, no JAX).

How many drafted tokens of each request one verification step checks
(design: ``FEATURES.md`` section 4; DSpark paper, Algorithm 1).

* :func:`plan_varlen` -- Algorithm 1.  ``conf_RK[r, i]`` is the confidence head's
  c_{r,i} = P(draft i of request r accepted | drafts < i accepted); the prefix survival is
  a_{r,j} = prod_{i<=j} c_{r,i}.  Start with every l_r = 0 (each row still verifies its one
  sampled token), B = R step tokens, tau = R expected tokens, best = R * SPS(R).  Walk the
  positions (r, j) with a_{r,j} > 0 in descending a (ties: lower j, then lower r); each one
  sets l_r = j, B += 1, tau += a_{r,j}, theta = tau * SPS(B) (expected tokens per second);
  keep it while theta improves, STOP at the first non-improvement (theta <= best).
  Because a is non-increasing in j, a row's positions come in order, so the choice is
  prefix-closed.  On a whole array of probabilities the order is one sort of all
  positions, then the stopping rule runs over its prefixes (vectorised: this runs every
  step).  On a lazy array-like the walk is a heap over one frontier position per row, and
  the frontier of a row advances (reading its next confidence) only after its current
  position was taken: confidences past the stopping point are never read.
  With ``buckets`` (the engine's token buckets), a step of B tokens runs at its padded bucket,
  so within a bucket every further position is free and improves theta; the stopping rule is
  then applied only where the cost can change: at bucket ends and at the walk's end (all
  positive positions taken, or the token cap reached).  Without it, a step-shaped SPS stops
  the walk at the first position past a bucket boundary even when filling the next bucket
  wins (the plain rule compares one extra token against the whole jump in step time).
* :func:`plan_varlen_async` -- the production variant for async scheduling, where the step's
  token count must be fixed before this step's confidences leave the device: the total
  budget K_total (extra draft tokens) is Algorithm 1 run on the confidences of two steps
  earlier (:func:`varlen_budget`); the split over requests (:func:`split_budget`) takes the
  K_total positions of highest CURRENT cumulative confidence, in the same order as the walk.
* :class:`ForwardRuntimeEstimator` -- forward seconds as a function of step tokens B (a
  profiled curve, corrected online); gives the SPS callable.
* :class:`SamplerRuntimeEstimator` -- sampler seconds per request count (sliding-window medians).
* :class:`TemperatureCalibrator` -- per-draft-position temperature scaling of the confidence
  logits (the paper's STS), fitted by Newton steps on the binary cross-entropy.

``sps`` arguments are either a callable ``tokens -> steps/s`` or an object with ``.sps(B)``.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np

__all__ = [
    "ForwardRuntimeEstimator",
    "SamplerRuntimeEstimator",
    "TemperatureCalibrator",
    "plan_varlen",
    "plan_varlen_async",
    "split_budget",
    "step_sps",
    "varlen_budget",
]


def _sps_fn(sps) -> Callable[[int], float]:
    if hasattr(sps, "sps"):
        return sps.sps
    if callable(sps):
        return sps
    raise TypeError(f"sps must be a callable tokens -> steps/s or have .sps(B), got {type(sps).__name__}")


class _Survival:
    """Lazy prefix survival a_{r,j} (j = 1..K) of ``conf_RK``: reads c_{r,j} only when asked for a_{r,j}."""

    def __init__(self, conf_RK, cumulative: bool):
        self.conf = conf_RK
        self.cumulative = cumulative
        self.R, self.K = conf_RK.shape

    def first(self, r: int) -> float:
        return float(self.conf[r, 0])

    def next(self, r: int, j: int, a_prev: float) -> float:
        """a_{r,j} (1-based j >= 2) from a_{r,j-1} = ``a_prev``."""
        if self.cumulative:
            return min(float(self.conf[r, j - 1]), a_prev)  # guard: a never rises along a row
        return a_prev * float(self.conf[r, j - 1])


def _as_RK(conf_RK):
    """[R, K] confidences; any non-list object with ``shape`` and 2-D indexing is used as it is
    (read element by element, lazily), anything else goes through ``np.asarray``."""
    if hasattr(conf_RK, "shape") and hasattr(conf_RK, "__getitem__") and not isinstance(conf_RK, np.ndarray):
        conf = conf_RK
    else:
        conf = np.asarray(conf_RK, dtype=np.float64)
    if len(conf.shape) != 2:
        raise ValueError(f"confidences must be [R, K], got shape {conf.shape}")
    return conf


def _walk(surv: _Survival, on_take: Callable[[int, int, float], bool]) -> np.ndarray:
    """Visit the positions in Algorithm 1's order (descending a; ties lower j, then lower r), calling
    ``on_take(r, j, a)``; the walk stops when it returns False (that position is not taken) or when
    no positive position is left.  Returns the lengths taken."""
    lengths = np.zeros(surv.R, dtype=np.int64)
    if surv.K == 0:
        return lengths
    heap = []
    for r in range(surv.R):
        a = surv.first(r)
        if a > 0:  # NaN and non-positive values are never taken
            heap.append((-a, 1, r))
    heapq.heapify(heap)
    while heap:
        neg_a, j, r = heapq.heappop(heap)
        a = -neg_a
        if not on_take(r, j, a):
            break
        lengths[r] = j
        if j < surv.K:
            a_next = surv.next(r, j + 1, a)
            if a_next > 0:
                heapq.heappush(heap, (-a_next, j + 1, r))
    return lengths


def plan_varlen(conf_RK, sps, max_tokens: int | None = None, *, cumulative: bool = False,
                buckets: Sequence[int] | None = None) -> np.ndarray:
    """Algorithm 1: the number of drafts l_r in 0..K each request verifies this step.

    ``conf_RK``: [R, K] conditional confidences c_{r,i} (probabilities), or, with
    ``cumulative=True``, the prefix survivals a_{r,j} themselves.  ``sps``: steps per second at
    B step tokens.  ``max_tokens``: optional cap on the step tokens B = R + sum(l_r) (the walk
    stops when the next position would exceed it; below R it plans no drafts).  ``buckets``:
    the step token counts the step is padded to; the stopping rule is tested only at these
    token counts and at the walk's end (module docstring), so positions between two of them
    are taken or dropped together.  The walk then reads up to one bucket of confidences past
    its stop.  Returns int64 [R].  The step verifies R + sum(l_r) tokens.
    """
    conf = _as_RK(conf_RK)
    sps = _sps_fn(sps)
    R = conf.shape[0]
    if R == 0:
        return np.zeros(0, dtype=np.int64)
    ends = _bucket_ends(buckets)
    if _sortable(conf, cumulative):
        return _plan_sorted(conf, sps, max_tokens, cumulative, ends)
    taken: list[tuple[int, int]] = []
    state = {"tau": float(R), "best": R * sps(R), "n_best": 0, "stopped": False}

    def take(r, j, a):
        B = R + len(taken) + 1
        if max_tokens is not None and B > max_tokens:
            return False  # the cap: the walk's end
        tau = state["tau"] + a
        if ends is None or B in ends:
            theta = tau * sps(B)
            if not theta > state["best"]:
                state["stopped"] = True
                return False
            state.update(best=theta, n_best=len(taken) + 1)
        taken.append((r, j))
        state["tau"] = tau
        return True

    _walk(_Survival(conf, cumulative), take)
    n = len(taken)
    if n > state["n_best"] and not state["stopped"] and state["tau"] * sps(R + n) > state["best"]:
        state["n_best"] = n  # the walk's end (between two bucket ends) improves: keep the tail
    lengths = np.zeros(R, dtype=np.int64)
    for r, j in taken[:state["n_best"]]:
        lengths[r] = j
    return lengths


def _bucket_ends(buckets) -> frozenset[int] | None:
    if buckets is None:
        return None
    ends = frozenset(int(b) for b in buckets)
    if not ends or min(ends) < 1:
        raise ValueError(f"buckets must be positive token counts, got {list(buckets)}")
    return ends


def _sortable(conf, cumulative: bool) -> bool:
    """Whether the walk's order is one sort of all positions: a whole finite array whose prefix
    survivals never rise along a row (probabilities, or ``cumulative`` survivals, which the
    walk's guard makes non-increasing). Lazy array-likes keep the frontier walk, which reads
    no confidence past the stop."""
    if not isinstance(conf, np.ndarray) or not np.isfinite(conf).all():
        return False
    return cumulative or bool(((conf >= 0) & (conf <= 1)).all())


def _plan_sorted(conf: np.ndarray, sps: Callable[[int], float], max_tokens: int | None,
                 cumulative: bool, ends: frozenset[int] | None = None) -> np.ndarray:
    """:func:`plan_varlen` on a sortable array, vectorised: the positions sorted once in the
    walk's order (the frontier walk pops exactly this order when survivals never rise along a
    row), the running tau as one sequential cumulative sum (the walk's own additions, so the
    same floats), then the stopping rule over the prefixes (or, with bucket ends, over the
    prefixes ending at one and the last), asking ``sps`` only up to the stop."""
    R, K = conf.shape
    lengths = np.zeros(R, dtype=np.int64)
    if K == 0:
        return lengths
    a_RK = np.minimum.accumulate(conf, axis=1) if cumulative else np.cumprod(conf, axis=1)
    live_RK = np.logical_and.accumulate(a_RK > 0, axis=1)  # the walk drops a row at its first a <= 0
    r_P, j_P = np.nonzero(live_RK)
    a_P = a_RK[r_P, j_P]
    order = np.lexsort((r_P, j_P, -a_P))  # descending a, then lower j, then lower r
    n_max = len(order) if max_tokens is None else max(0, min(len(order), int(max_tokens) - R))
    tau_N = np.cumsum(np.concatenate([[float(R)], a_P[order[:n_max]]]))
    if ends is None:
        candidates = range(1, n_max + 1)
    else:
        candidates = sorted({b - R for b in ends if 0 < b - R < n_max} | ({n_max} if n_max else set()))
    best = tau_N[0] * sps(R)
    n = 0
    for c in candidates:
        theta = tau_N[c] * sps(R + c)
        if not theta > best:
            break
        best, n = theta, c
    taken = order[:n]
    np.maximum.at(lengths, r_P[taken], j_P[taken] + 1)
    return lengths


def varlen_budget(conf_RK, sps, max_tokens: int | None = None, *, cumulative: bool = False) -> int:
    """K_total: the extra draft tokens Algorithm 1 plans for ``conf_RK`` (sum of its lengths)."""
    return int(plan_varlen(conf_RK, sps, max_tokens, cumulative=cumulative).sum())


def split_budget(conf_RK, k_total: int, *, cumulative: bool = False) -> np.ndarray:
    """Give ``k_total`` draft positions to the rows: the first ``k_total`` positions of the walk
    order (descending current cumulative confidence a_{r,j}; ties lower j, then lower r; only
    a > 0).  Prefix-closed; reads no confidence past the last position given (plus one per row)."""
    conf = _as_RK(conf_RK)
    left = [int(k_total)]

    def take(r, j, a):
        if left[0] <= 0:
            return False
        left[0] -= 1
        return True

    return _walk(_Survival(conf, cumulative), take)


def plan_varlen_async(conf_RK, budget_conf_QK, sps, max_tokens: int | None = None, *,
                      cumulative: bool = False) -> np.ndarray:
    """Production variant of :func:`plan_varlen` for async scheduling.

    ``budget_conf_QK``: the confidences of two steps earlier (the latest ones on the host when
    this step's shapes are fixed; Q rows, Q may differ from R), or an int K_total directly.
    The budget K_total = :func:`varlen_budget` of them, scaled by R / Q when the row counts
    differ (rounded), capped by ``max_tokens - R``.  The split over this step's rows ranks the
    CURRENT cumulative confidences (:func:`split_budget`).

    Properties (tests/test_spec_varlen.py): the step's token count R + sum(l) depends on the
    current confidences only through the number of positive positions (it is min(K_total,
    #positive)); and whether position (r, j) is verified never depends on the confidences
    c_{r,i}, i > j, of later positions of its own row (they can only lower a_{r,i} for i > j,
    which always ranks after (r, j)).
    """
    conf = _as_RK(conf_RK)
    R = conf.shape[0]
    if isinstance(budget_conf_QK, (int, np.integer)):
        k_total = int(budget_conf_QK)
    else:
        old = _as_RK(budget_conf_QK)
        k_total = varlen_budget(old, sps, cumulative=cumulative)
        Q = old.shape[0]
        if Q != R:
            k_total = int(round(k_total * R / Q)) if Q else 0
    if max_tokens is not None:
        k_total = min(k_total, max(0, int(max_tokens) - R))
    return split_budget(conf, k_total, cumulative=cumulative)


# ----------------------------------------------------------------------------- runtime estimators


class ForwardRuntimeEstimator:
    """Forward seconds of one step as a function of its token count B.

    Base curve: the points ``(B, seconds)`` profiled at start-up, interpolated piecewise
    linearly, extrapolated linearly beyond either end from the two outermost points (clamped
    to at least ``min_seconds``).  One point gives a constant curve.

    Online correction (ratio correction per bucket): every ``observe(B, s)`` updates an
    exponential moving average, weight ``alpha``, of the ratio s / base(B), both for B's
    bucket (the index of the nearest profiled point) and globally.  ``seconds(B)`` is
    base(B) times the bucket's ratio once the bucket has ``min_obs`` observations, else the
    global ratio once anything was observed, else 1.  The ratio keeps the curve's shape and
    tracks drift (clocks, contention, another context length) from a few observations.  One
    observation moves a ratio by at most a factor ``max_jump`` (its ratio is clipped to within
    that factor of the current estimate): a single outlier (a compile, a pause) cannot make a
    step kind look several times slower than it is for the many steps the average takes to
    forget it.
    """

    def __init__(self, points: Sequence[tuple[float, float]], alpha: float = 0.1, min_obs: int = 3,
                 min_seconds: float = 1e-6, max_jump: float = 2.0) -> None:
        pts = sorted((float(b), float(s)) for b, s in points)
        if not pts:
            raise ValueError("ForwardRuntimeEstimator needs at least one profiled (tokens, seconds) point")
        if any(s <= 0 for _, s in pts):
            raise ValueError("profiled seconds must be positive")
        if len({b for b, _ in pts}) != len(pts):
            raise ValueError("profiled token counts must be distinct")
        if not 0 < alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        if not max_jump > 1:
            raise ValueError("max_jump must be > 1")
        self.max_jump = max_jump
        self.tokens = [b for b, _ in pts]
        self.base_seconds = [s for _, s in pts]
        self.alpha = alpha
        self.min_obs = min_obs
        self.min_seconds = min_seconds
        self._ratio = [1.0] * len(pts)
        self._count = [0] * len(pts)
        self._global_ratio = 1.0
        self._global_count = 0

    def base(self, tokens: float) -> float:
        """The profiled curve at ``tokens`` (no online correction)."""
        xs, ys = self.tokens, self.base_seconds
        if len(xs) == 1:
            return ys[0]
        i = bisect.bisect_left(xs, tokens)
        i = min(max(i, 1), len(xs) - 1)  # segment [i-1, i]; the end segments extrapolate
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(self.min_seconds, y0 + (y1 - y0) * (tokens - x0) / (x1 - x0))

    def bucket(self, tokens: float) -> int:
        i = bisect.bisect_left(self.tokens, tokens)
        if i == 0:
            return 0
        if i == len(self.tokens):
            return i - 1
        return i if self.tokens[i] - tokens < tokens - self.tokens[i - 1] else i - 1

    def ratio(self, tokens: float) -> float:
        k = self.bucket(tokens)
        if self._count[k] >= self.min_obs:
            return self._ratio[k]
        return self._global_ratio if self._global_count else 1.0

    def seconds(self, tokens: float) -> float:
        return max(self.min_seconds, self.base(tokens) * self.ratio(tokens))

    def sps(self, tokens: float) -> float:
        return 1.0 / self.seconds(tokens)

    def __call__(self, tokens: float) -> float:
        return self.sps(tokens)

    def observe(self, tokens: float, seconds: float) -> None:
        if not seconds > 0 or not math.isfinite(seconds):
            return
        ref = self.ratio(tokens)
        q = min(max(seconds / self.base(tokens), ref / self.max_jump), ref * self.max_jump)
        k = self.bucket(tokens)
        self._ratio[k] = q if self._count[k] == 0 else (1 - self.alpha) * self._ratio[k] + self.alpha * q
        self._count[k] += 1
        self._global_ratio = (q if self._global_count == 0
                              else (1 - self.alpha) * self._global_ratio + self.alpha * q)
        self._global_count += 1


class SamplerRuntimeEstimator:
    """Sampler seconds of one step, keyed by its request count.

    The median of the last ``window`` observations with that request count once there are at
    least ``min_samples`` of them, else the median of the last ``window`` observations of any
    count, else ``default``.
    """

    def __init__(self, window: int = 64, min_samples: int = 5, default: float = 0.0) -> None:
        if window < 1 or min_samples < 1:
            raise ValueError("window and min_samples must be >= 1")
        self.window = window
        self.min_samples = min_samples
        self.default = default
        self._by_key: dict[int, deque] = {}
        self._all: deque = deque(maxlen=window)

    def observe(self, num_requests: int, seconds: float) -> None:
        q = self._by_key.get(num_requests)
        if q is None:
            q = self._by_key[num_requests] = deque(maxlen=self.window)
        q.append(float(seconds))
        self._all.append(float(seconds))

    def seconds(self, num_requests: int) -> float:
        q = self._by_key.get(num_requests)
        if q is not None and len(q) >= self.min_samples:
            return float(np.median(q))
        if self._all:
            return float(np.median(self._all))
        return self.default


def step_sps(forward: ForwardRuntimeEstimator, sampler: SamplerRuntimeEstimator | None = None,
             num_requests: int = 0) -> Callable[[int], float]:
    """SPS(B) = 1 / (forward seconds at B + sampler seconds at ``num_requests``) as a callable."""
    extra = sampler.seconds(num_requests) if sampler is not None else 0.0
    return lambda tokens: 1.0 / (forward.seconds(tokens) + extra)


# ----------------------------------------------------------------------------- calibration (STS)


def _sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))


class TemperatureCalibrator:
    """Per-draft-position temperature scaling of confidence logits (the paper's STS).

    Position k's calibrated confidence is sigmoid(z / T_k).  ``fit`` minimises, for every k
    separately, the binary cross-entropy of sigmoid(beta * z) against the observed
    acceptance over the pairs (z, accepted) that reached position k (``mask``), in
    beta = 1 / T_k: a one-feature logistic regression without intercept, convex in beta, solved
    by damped Newton steps.  Positions with fewer than ``min_pairs`` pairs (or no signal) keep T = 1.
    """

    def __init__(self, num_positions: int, min_pairs: int = 10) -> None:
        self.temperature_K = np.ones(num_positions)
        self.min_pairs = min_pairs

    def fit(self, conf_logits_NK, accepted_NK, mask_NK=None, iters: int = 25) -> TemperatureCalibrator:
        z = np.asarray(conf_logits_NK, dtype=np.float64)
        y = np.asarray(accepted_NK, dtype=np.float64)
        m = np.ones_like(z, dtype=bool) if mask_NK is None else np.asarray(mask_NK, dtype=bool)
        if z.shape != y.shape or z.shape != m.shape or z.ndim != 2 or z.shape[1] != len(self.temperature_K):
            raise ValueError(f"fit wants [N, {len(self.temperature_K)}] logits, accepted and mask of one shape")
        for k in range(z.shape[1]):
            sel = m[:, k] & np.isfinite(z[:, k])
            zk, yk = z[sel, k], y[sel, k]
            if len(zk) < self.min_pairs or not np.any(zk):
                continue
            beta = self._newton(zk, yk, iters)
            if beta is not None:
                self.temperature_K[k] = 1.0 / beta
        return self

    @staticmethod
    def bce(beta: float, z, y) -> float:
        p = np.clip(_sigmoid(beta * z), 1e-12, 1 - 1e-12)
        return float(-(y * np.log(p) + (1 - y) * np.log(1 - p)).mean())

    @classmethod
    def _newton(cls, z, y, iters: int) -> float | None:
        beta, loss = 1.0, cls.bce(1.0, z, y)
        for _ in range(iters):
            p = _sigmoid(beta * z)
            g = float(((p - y) * z).mean())
            h = float((p * (1 - p) * z * z).mean())
            if h <= 1e-12:
                break
            step = g / h
            for _ in range(30):  # backtrack; keep beta > 0 (temperature positive)
                nb = beta - step
                if nb > 0:
                    nl = cls.bce(nb, z, y)
                    if nl <= loss:
                        break
                step *= 0.5
            else:
                break
            beta, loss_old, loss = nb, loss, nl
            if abs(loss_old - loss) < 1e-12:
                break
        return beta if beta > 0 and math.isfinite(beta) else None

    def calibrate(self, conf_logits_RK) -> np.ndarray:
        """Calibrated confidences sigmoid(z / T_k), [R, K] probabilities."""
        z = np.asarray(conf_logits_RK, dtype=np.float64)
        return _sigmoid(z / self.temperature_K[: z.shape[-1]])
