"""The jitted on-device sampler and its host-side batch builder.

Glossary: R = rows (requests sampled this step, padded), V = vocab, N = number of top logprobs
returned (static), B = banned ids per row (static, from the array shape).

Per row, in vLLM's order:

0. With structured output, ids outside the row's int32 bitmask ``allowed_RW`` (``[R, W]``,
   ``W = ceil(V/32)``, the xgrammar layout; all ones for rows without a grammar) are set to
   ``-inf``; without any grammar row the step passes ``None`` and nothing is masked.
1. ``banned_RB`` ids are set to ``-inf`` (the engine bans EOS and ``stop_token_ids`` while fewer
   than ``min_tokens`` tokens are out; see ``min_tokens_banned_ids``).
2. Greedy rows (``temperature < SAMPLING_EPS``, i.e. 0) take the argmax; ties go to the lowest id.
3. Other rows: ``logits / temperature``, then min-p (drop ``p < min_p * p_max``), top-k (keep the
   values >= the k-th largest), top-p (on the renormalised survivors, keep the smallest set of
   highest-probability tokens whose mass reaches ``top_p``; the top token always stays). This is
   the order of vLLM's V1 sampler (temperature -> min-p -> top-k/top-p); min-p and top-k commute,
   so the order only matters in that top-p renormalises after the min-p cut. Every filter keeps a
   prefix of the row sorted by value, so all three reduce to one per-row *cutoff value* found
   with one sort; tokens below the cutoff become ``-inf`` (ties with the cutoff are kept).
4. A token is drawn by Gumbel-max: ``argmax(filtered + gumbel)``. The noise of a row comes from the
   key ``fold_in(wrap_key_data(seed, threefry2x32), position)`` (vmapped over rows), so a row's
   token depends only on its seed, its position and its own logits: it is the same alone, at
   any row of any batch, with any padding, and on every call.

The seed is a 64-bit integer stored as two uint32 words ``(hi, lo) = (seed >> 32, seed & 0xFFFFFFFF)``;
these are exactly the key words of ``jax.random.key(seed, impl="threefry2x32")`` (with x64 on; for
seeds below 2**32 also without). The PRNG implementation is fixed to threefry2x32, independent of
``jax_default_prng_impl``.

Logprobs are vLLM's default ``raw_logprobs``: ``log_softmax`` of the logits as they come from the
model, before banning, temperature and filters.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.base import batch_invariant as bi
from deepinfer_jax.sampling.params import SAMPLING_EPS, SamplingParams

PRNG_IMPL = "threefry2x32"
SEED_LIMIT = 2**64
POSITION_LIMIT = 2**31


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingBatch:
    """Per-row sampling state of one step. The arrays may be numpy (host) or jax (device).

    ``all_greedy`` and ``needs_filter`` are static hints (part of the pytree structure, so each
    combination compiles once): ``all_greedy`` skips the random path, ``needs_filter=False``
    skips the sort of the min-p / top-k / top-p filters. The defaults are always correct;
    ``build_sampling_batch`` sets them from the rows. Neither changes any row's result.
    """

    temperature: jax.Array  # f32 [R]; < SAMPLING_EPS (0) = greedy
    top_k: jax.Array        # int32 [R]; 0 = off
    top_p: jax.Array        # f32 [R]; 1 = off
    min_p: jax.Array        # f32 [R]; 0 = off
    seed: jax.Array         # uint32 [R, 2]: (hi, lo) words of the 64-bit request seed
    position: jax.Array     # int32 [R]: position of the token being sampled in its sequence
    banned_RB: jax.Array    # int32 [R, B]: token ids set to -inf; -1 = none
    all_greedy: bool = dataclasses.field(default=False, metadata=dict(static=True))
    needs_filter: bool = dataclasses.field(default=True, metadata=dict(static=True))

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplerOutput:
    token_ids: jax.Array     # int32 [R]
    logprob: jax.Array       # f32 [R]: raw log_softmax(logits)[token_ids]
    top_ids: jax.Array       # int32 [R, N]: top-N ids of the raw distribution, descending
    top_logprobs: jax.Array  # f32 [R, N]


# --------------------------------------------------------------------------- host side


class SampleRow(NamedTuple):
    """One row of ``build_sampling_batch`` (a plain ``(params, seed, position[, banned])`` tuple
    works too)."""

    params: SamplingParams
    seed: int                    # the effective 64-bit seed (the engine draws one if params.seed is None)
    position: int                # position of the token being sampled
    banned: Sequence[int] = ()   # token ids to ban this step (see min_tokens_banned_ids)


def split_seed(seed: int) -> tuple[int, int]:
    """A seed in ``[0, 2**64)`` as its ``(hi, lo)`` uint32 words."""
    if not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"seed={seed!r}: must be in [0, 2**64)")
    return seed >> 32, seed & 0xFFFFFFFF


def min_tokens_banned_ids(params: SamplingParams, num_generated: int,
                          eos_token_ids: Sequence[int]) -> list[int]:
    """Ids to ban while ``num_generated < params.min_tokens`` (as vLLM's min-tokens processor):
    ``stop_token_ids`` and, unless ``ignore_eos``, the EOS ids. Empty once enough are out."""
    if num_generated >= params.min_tokens:
        return []
    ids = list(params.stop_token_ids)
    if not params.ignore_eos:
        ids += list(eos_token_ids)
    return sorted(set(int(t) for t in ids))


def build_sampling_batch(rows: Sequence[SampleRow | tuple], num_rows: int, vocab: int,
                         num_banned: int | None = None) -> SamplingBatch:
    """Pack rows ``(params, seed, position[, banned_ids])`` into a numpy ``SamplingBatch`` of
    ``num_rows`` rows; padding rows are greedy with nothing banned. ``num_banned`` (B) defaults
    to the longest banned list rounded up to a power of two (at least 1); fix it to avoid
    recompiles. ``params`` are assumed validated; greedy params (``is_greedy``) become
    ``temperature=0`` with the filters off, ``top_k >= vocab`` becomes 0."""
    rows = [r if isinstance(r, SampleRow) else SampleRow(*r) for r in rows]
    if len(rows) > num_rows:
        raise ValueError(f"num_rows={num_rows} < {len(rows)} rows")
    params, seeds, positions, banned = (list(c) for c in zip(*rows)) if rows else ([], [], [], [])
    return sampling_batch_of(np.arange(len(rows)), params, seeds, positions, banned, num_rows, vocab, num_banned)


def _row_index(row_R: np.ndarray) -> slice | np.ndarray:
    """Where sampler rows ``row_R`` go: a slice when they are ``0..n-1`` (the engine's usual
    step: slice writes instead of scattered ones), else ``row_R`` itself."""
    n = row_R.shape[0]
    if n and row_R[0] == 0 and row_R[-1] == n - 1 and bool((row_R[1:] > row_R[:-1]).all()):
        return slice(0, n)
    return row_R


class SamplingReuse:
    """What ``sampling_batch_of`` may reuse from the batch it built last (one per caller, e.g.
    a runner): the per-row params and seed arrays, kept while the sampler rows are ``0..n-1``
    with the same params objects (identity) and seeds as then (steady decoding), and the
    nothing-banned array of each shape. Reused arrays are read-only (shared between steps)."""

    __slots__ = ("key", "params", "seeds", "arrays", "no_bans")

    def __init__(self):
        self.key = self.params = self.seeds = self.arrays = None
        self.no_bans: dict[tuple[int, int], np.ndarray] = {}


def _read_only(*arrays: np.ndarray) -> None:
    for a in arrays:
        a.flags.writeable = False


def sampling_batch_of(row_R, params: Sequence[SamplingParams], seeds: Sequence[int], positions,
                      banned: Sequence[Sequence[int]], num_rows: int, vocab: int,
                      num_banned: int | None = None, reuse: SamplingReuse | None = None) -> SamplingBatch:
    """``build_sampling_batch`` from columns: sampler rows ``row_R`` (ints below ``num_rows``)
    get ``params[i]``, ``seeds[i]``, ``positions[i]`` and ``banned[i]``; every other row is
    padding. Vectorised over rows (the engine builds this every step for up to
    ``max_num_seqs`` rows): when every row has the same params object, its values are read once.
    ``reuse``: arrays of the previous call to reuse where they are the same (``SamplingReuse``)."""
    row_R = np.asarray(row_R, np.int64)
    n = row_R.shape[0]
    longest = max(map(len, banned), default=0)
    if num_banned is None:
        num_banned = 1 << max(0, longest - 1).bit_length()
    elif longest > num_banned:
        raise ValueError(f"num_banned={num_banned} < {longest} banned ids in one row")
    rows = _row_index(row_R)

    if reuse is not None and isinstance(rows, slice):
        seeds = seeds if isinstance(seeds, list) else list(seeds)
        key = (n, num_rows, vocab)
        if not (reuse.key == key and reuse.seeds == seeds and all(map(operator.is_, params, reuse.params))):
            arrays = _param_columns(rows, row_R, params, seeds, num_rows, vocab)
            _read_only(*arrays[:5])
            reuse.key, reuse.params, reuse.seeds, reuse.arrays = key, list(params), seeds, arrays
        temperature, top_k, top_p, min_p, seed, all_greedy, needs_filter = reuse.arrays
    else:
        temperature, top_k, top_p, min_p, seed, all_greedy, needs_filter = _param_columns(
            rows, row_R, params, seeds, num_rows, vocab)
    pos_R = np.asarray(positions, np.int64).reshape(n)
    out_of_range = (pos_R < 0) | (pos_R >= POSITION_LIMIT)
    if out_of_range.any():
        i = int(np.argmax(out_of_range))
        raise ValueError(f"row {int(row_R[i])}: position={positions[i]!r} out of range [0, 2**31)")
    position = np.zeros(num_rows, np.int32)
    position[rows] = pos_R
    if not longest and reuse is not None:  # nothing banned: a constant of the shape
        ban = reuse.no_bans.get((num_rows, num_banned))
        if ban is None:
            ban = reuse.no_bans[num_rows, num_banned] = np.full((num_rows, num_banned), -1, np.int32)
            _read_only(ban)
    else:
        ban = np.full((num_rows, num_banned), -1, np.int32)
    if longest:
        for i in (i for i, b in enumerate(banned) if b):
            b = banned[i]
            bad = [t for t in b if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"row {int(row_R[i])}: banned token ids {bad} out of range [0, {vocab})")
            ban[row_R[i], :len(b)] = b
    return SamplingBatch(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                         position=position, banned_RB=ban, all_greedy=all_greedy, needs_filter=needs_filter)


def _param_columns(rows, row_R, params, seeds, num_rows: int, vocab: int) -> tuple:
    """(temperature, top_k, top_p, min_p, seed, all_greedy, needs_filter) of ``sampling_batch_of``."""
    n = row_R.shape[0]
    # one params object for every row (the common case): its values once; else a column each
    p0 = params[0] if n else None
    if n and all(map(operator.is_, params, itertools.repeat(p0, n))):
        vals = np.array([[p0.is_greedy, p0.temperature, p0.top_k, p0.top_p, p0.min_p]], np.float64)
    else:
        vals = np.stack([np.fromiter(map(operator.attrgetter(f), params), np.float64, n)
                         for f in ("is_greedy", "temperature", "top_k", "top_p", "min_p")], axis=1)
    # (a [1, 5] vals broadcasts over the rows)
    greedy = vals[:, 0] != 0
    temperature = np.zeros(num_rows, np.float32)
    temperature[rows] = np.where(greedy, 0.0, vals[:, 1])
    tk = vals[:, 2].astype(np.int64)
    top_k = np.zeros(num_rows, np.int32)
    top_k[rows] = np.where(~greedy & (tk > 0) & (tk < vocab), tk, 0)
    top_p = np.ones(num_rows, np.float32)
    top_p[rows] = np.where(greedy, 1.0, vals[:, 3])
    min_p = np.zeros(num_rows, np.float32)
    min_p[rows] = np.where(greedy, 0.0, vals[:, 4])
    try:
        seed_R = np.fromiter(seeds, np.uint64, n)  # OverflowError outside [0, 2**64)
    except OverflowError:
        for s in seeds:
            split_seed(int(s))  # raises, naming the seed
        raise
    seed = np.zeros((num_rows, 2), np.uint32)
    seed[rows, 0] = seed_R >> np.uint64(32)
    seed[rows, 1] = seed_R & np.uint64(0xFFFFFFFF)
    sampled = temperature >= SAMPLING_EPS
    needs_filter = bool(np.any(sampled & ((top_k > 0) | (top_p < 1) | (min_p > 0))))
    return temperature, top_k, top_p, min_p, seed, not bool(sampled.any()), needs_filter


# --------------------------------------------------------------------------- device side


def unpack_bitmask(mask_XW: jax.Array, vocab: int) -> jax.Array:
    """bool ``[..., vocab]`` from an int32 bitmask ``[..., ceil(vocab/32)]`` (bit ``v % 32`` of
    word ``v // 32`` set = token ``v`` allowed), the xgrammar layout."""
    words = jax.lax.bitcast_convert_type(jnp.asarray(mask_XW, jnp.int32), jnp.uint32)
    v = jnp.arange(vocab)
    bits = jnp.take(words, v // 32, axis=-1) >> (v % 32).astype(jnp.uint32)
    return (bits & 1).astype(jnp.bool_)


def ban_tokens(logits_RV: jax.Array, banned_RB: jax.Array) -> jax.Array:
    """``logits_RV`` with each row's ``banned_RB`` ids (``-1`` = none) set to ``-inf``."""
    R, V = logits_RV.shape
    ids_RB = jnp.where((banned_RB >= 0) & (banned_RB < V), banned_RB, V)  # V: dropped
    rows_R1 = jnp.arange(R)[:, None]
    return logits_RV.at[rows_R1, ids_RB].set(-jnp.inf, mode="drop")


def filter_cutoff(logits_RV: jax.Array, top_k_R: jax.Array, top_p_R: jax.Array,
                  min_p_R: jax.Array) -> jax.Array:
    """Per-row cutoff value ``[R]``: min-p, then top-k, then top-p keep exactly the tokens with
    ``logits_RV >= cutoff``. ``logits_RV`` are the temperature-scaled logits. One sort per row."""
    R, V = logits_RV.shape
    asc_RV = jnp.sort(logits_RV, axis=-1)
    max_R1 = asc_RV[:, -1:]
    # min-p: p / p_max = exp(l - l_max) >= min_p (min_p = 0 keeps everything)
    keep_RV = jnp.exp(asc_RV - max_R1) >= min_p_R[:, None]
    # top-k: values >= the k-th largest (ties with it kept, as vLLM)
    k_R = jnp.where((top_k_R <= 0) | (top_k_R >= V), V, top_k_R)
    kth_R1 = jnp.take_along_axis(asc_RV, (V - k_R)[:, None], axis=-1)
    keep_RV &= asc_RV >= kth_R1
    # top-p on the renormalised survivors: drop the low tail of mass <= 1 - top_p (the mass of
    # each token and all below it is an ascending cumsum, as vLLM); top_p >= 1 keeps everything
    probs_RV = bi.softmax(jnp.where(keep_RV, asc_RV, -jnp.inf), axis=-1)
    tail_RV = jnp.cumsum(probs_RV, axis=-1)
    top_p_R1 = top_p_R[:, None]
    keep_RV &= (tail_RV > 1 - top_p_R1) | (top_p_R1 >= 1)
    keep_RV = keep_RV.at[:, -1].set(True)  # the top token always stays
    first_R = jnp.argmax(keep_RV, axis=-1)  # the kept tokens are a suffix of asc_RV
    return jnp.take_along_axis(asc_RV, first_R[:, None], axis=-1)[:, 0]


def apply_filters(logits_RV: jax.Array, top_k_R: jax.Array, top_p_R: jax.Array,
                  min_p_R: jax.Array) -> jax.Array:
    """``logits_RV`` (temperature-scaled) with the tokens min-p / top-k / top-p drop set to ``-inf``."""
    cutoff_R = filter_cutoff(logits_RV, top_k_R, top_p_R, min_p_R)
    return jnp.where(logits_RV >= cutoff_R[:, None], logits_RV, -jnp.inf)


def row_keys(seed_R2: jax.Array, position_R: jax.Array) -> jax.Array:
    """One threefry key per row: ``fold_in(key(seed), position)``."""
    keys_R = jax.random.wrap_key_data(jnp.asarray(seed_R2, jnp.uint32), impl=PRNG_IMPL)
    return jax.vmap(jax.random.fold_in)(keys_R, jnp.asarray(position_R, jnp.int32))


def gumbel_noise(seed_R2: jax.Array, position_R: jax.Array, vocab: int) -> jax.Array:
    """Standard Gumbel noise ``f32 [R, vocab]``, each row from its own key (see ``row_keys``)."""
    return jax.vmap(lambda k: jax.random.gumbel(k, (vocab,), jnp.float32))(row_keys(seed_R2, position_R))


@functools.partial(jax.jit, static_argnames=("num_logprobs", "batch_invariant"))
def sample(logits_RV: jax.Array, sb: SamplingBatch, num_logprobs: int = 0,
           allowed_RW: jax.Array | None = None, batch_invariant: bool = False) -> SamplerOutput:
    """Sample one token per row of ``logits_RV`` ``[R, V]`` (see the module docstring) and return
    it with its raw logprob and the raw top-``num_logprobs`` (static; 0 gives ``[R, 0]``).
    ``allowed_RW``: the optional structured-output bitmask (``None`` = every id allowed).
    ``batch_invariant`` (static): the row reductions in a fixed order (``base/batch_invariant.py``)."""
    with bi.use(batch_invariant):
        return _sample(logits_RV, sb, num_logprobs, allowed_RW)


def _sample(logits_RV: jax.Array, sb: SamplingBatch, num_logprobs: int,
            allowed_RW: jax.Array | None) -> SamplerOutput:
    logits_RV = logits_RV.astype(jnp.float32)
    R, V = logits_RV.shape
    if sb.num_rows != R:
        raise ValueError(f"logits have {R} rows but the SamplingBatch has {sb.num_rows}")
    lse_R = bi.logsumexp(logits_RV, axis=-1)

    allowed_RV = ban_tokens(logits_RV, sb.banned_RB)
    if allowed_RW is not None:
        allowed_RV = jnp.where(unpack_bitmask(allowed_RW, V), allowed_RV, -jnp.inf)
    token_R = jnp.argmax(allowed_RV, axis=-1).astype(jnp.int32)  # greedy; ties -> lowest id
    if not sb.all_greedy:
        temperature_R = jnp.asarray(sb.temperature, jnp.float32)
        greedy_R = temperature_R < SAMPLING_EPS
        scaled_RV = allowed_RV / jnp.where(greedy_R, 1.0, temperature_R)[:, None]
        if sb.needs_filter:
            scaled_RV = apply_filters(scaled_RV, jnp.asarray(sb.top_k, jnp.int32),
                                      jnp.asarray(sb.top_p, jnp.float32), jnp.asarray(sb.min_p, jnp.float32))
        drawn_R = jnp.argmax(scaled_RV + gumbel_noise(sb.seed, sb.position, V), axis=-1).astype(jnp.int32)
        token_R = jnp.where(greedy_R, token_R, drawn_R)

    logprob_R = jnp.take_along_axis(logits_RV, token_R[:, None], axis=-1)[:, 0] - lse_R
    if num_logprobs > 0:
        top_vals_RN, top_ids_RN = jax.lax.top_k(logits_RV, num_logprobs)  # ties -> lower id first
        top_logprobs_RN = top_vals_RN - lse_R[:, None]
    else:
        top_ids_RN = jnp.zeros((R, 0), jnp.int32)
        top_logprobs_RN = jnp.zeros((R, 0), jnp.float32)
    return SamplerOutput(token_ids=token_R, logprob=logprob_R, top_ids=top_ids_RN.astype(jnp.int32),
                         top_logprobs=top_logprobs_RN)


def prompt_logprobs(logits_XV: jax.Array, targets_X: jax.Array, num_logprobs: int):
    """Raw log-probabilities of each row's target id and the top ``num_logprobs`` (ids, values):
    the prompt-logprobs rows of a step. Returns ``(target_lp [X], top_ids [X, N], top_lp [X, N])``."""
    lp = bi.log_softmax(logits_XV, axis=-1)
    tgt = jnp.take_along_axis(lp, targets_X[:, None], axis=1)[:, 0]
    if num_logprobs:
        top_lp, top_ids = jax.lax.top_k(lp, num_logprobs)
    else:
        top_lp, top_ids = lp[:, :0], jnp.zeros(lp[:, :0].shape, jnp.int32)
    return tgt, top_ids.astype(jnp.int32), top_lp
