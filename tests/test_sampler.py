"""SamplingParams validation and the jitted sampler (greedy, filters, determinism, logprobs)."""

from __future__ import annotations

import math
import re

import jax
import numpy as np
import pytest

from deepinfer_jax.sampling import (
    SamplingBatch,
    SamplingParams,
    build_sampling_batch,
    min_tokens_banned_ids,
    sample,
    sampling_params_from_dict,
)
from deepinfer_jax.sampling.sampler import apply_filters, row_keys, split_seed

RNG = np.random.default_rng(20240607)


def rand_logits(rows: int, vocab: int, scale: float = 3.0) -> np.ndarray:
    return (RNG.standard_normal((rows, vocab)) * scale).astype(np.float32)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def run(logits: np.ndarray, rows: list, num_rows: int | None = None, num_logprobs: int = 0,
        batch_invariant: bool = False, **kw):
    sb = build_sampling_batch(rows, num_rows or len(rows), logits.shape[1], **kw)
    out = sample(logits, sb, num_logprobs=num_logprobs, batch_invariant=batch_invariant)
    return jax.tree.map(np.asarray, out)


# --------------------------------------------------------------------------- SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.stop, p.stop_token_ids) == (16, 0, [], [])
    assert (p.ignore_eos, p.logprobs, p.prompt_logprobs, p.seed) == (False, None, None, None)
    assert (p.include_stop_str_in_output, p.skip_special_tokens) == (False, True)
    assert not p.is_greedy
    assert p.validate() is p


def test_normalisation_and_greedy():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b"), stop_token_ids=(3,)).stop_token_ids == [3]
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(top_k=1).is_greedy
    assert not SamplingParams(temperature=0.5, top_k=2).is_greedy


def test_seq_seed_alias():
    assert SamplingParams(seq_seed=7).seed == 7
    assert SamplingParams(seed=7, seq_seed=7).seed == 7
    with pytest.raises(ValueError, match=r"SamplingParams\.seq_seed=8: conflicts with seed=7"):
        SamplingParams(seed=7, seq_seed=8)
    with pytest.raises(ValueError, match=r"request 2: SamplingParams\.seq_seed=8"):
        sampling_params_from_dict({"seed": 7, "seq_seed": 8}, 2)
    assert sampling_params_from_dict({"seq_seed": 9}, 0).seed == 9


def test_unknown_field_is_value_error():
    with pytest.raises(ValueError, match=r"SamplingParams\.bogus=1: unknown field"):
        SamplingParams(bogus=1)
    with pytest.raises(ValueError, match=r"request 4: SamplingParams\.top_kk=3: unknown field \(did you mean 'top_k'\?\)"):
        sampling_params_from_dict({"temperature": 0.5, "top_kk": 3}, 4)


def test_from_dict_null_means_default():
    p = sampling_params_from_dict({"temperature": None, "stop": None, "max_tokens": 5}, 0)
    assert (p.temperature, p.stop, p.max_tokens) == (1.0, [], 5)


@pytest.mark.parametrize("field, value, why", [
    ("n", 0, "must be >= 1"),
    ("n", 1.5, "must be an integer"),
    ("temperature", -0.1, "must be a finite number >= 0"),
    ("temperature", float("nan"), "must be a finite number >= 0"),
    ("top_p", 1.5, r"must be in \(0, 1\]"),
    ("top_p", 0.0, r"must be in \(0, 1\]"),
    ("top_k", -2, "must be 0 or -1"),
    ("top_k", 2.0, "must be 0 or -1"),
    ("min_p", 1.1, r"must be in \[0, 1\]"),
    ("min_p", -0.1, r"must be in \[0, 1\]"),
    ("max_tokens", 0, "must be >= 1"),
    ("min_tokens", 17, r"must be in \[0, max_tokens=16\]"),
    ("min_tokens", -1, r"must be in \[0, max_tokens=16\]"),
    ("logprobs", 21, r"must be in \[0, 20\]"),
    ("logprobs", -1, r"must be in \[0, 20\]"),
    ("prompt_logprobs", 21, r"must be in \[0, 20\]"),
    ("seed", -1, r"must be None or an integer in \[0, 2\*\*63\)"),
    ("seed", 2**63, r"must be None or an integer in \[0, 2\*\*63\)"),
    ("stop", ["ok", ""], "non-empty strings"),
    ("stop_token_ids", [5, -3], r"token id -3 out of range"),
    ("stop_token_ids", [1000], r"token id 1000 out of range \[0, vocab_size=1000\)"),
    ("ignore_eos", 1, "must be a bool"),
])
def test_invalid_field_names_index_field_value(field, value, why):
    expected = rf"^request 3: SamplingParams\.{field}={re.escape(repr(value))}: .*{why}"
    with pytest.raises(ValueError, match=expected):
        SamplingParams(**{field: value}).validate(3, vocab_size=1000)
    with pytest.raises(ValueError, match=expected):
        sampling_params_from_dict({field: value}, 3, vocab_size=1000)
    # Without an index the message starts at the field.
    with pytest.raises(ValueError, match=rf"^SamplingParams\.{field}="):
        SamplingParams(**{field: value}).validate(vocab_size=1000)


def test_valid_edge_values():
    SamplingParams(temperature=0, top_p=1e-6, top_k=-1, min_p=1.0, max_tokens=1, min_tokens=1,
                   logprobs=0, prompt_logprobs=20, seed=2**63 - 1, stop_token_ids=[0, 999]).validate(0, vocab_size=1000)
    SamplingParams(logprobs=50).validate(max_logprobs=50)


# --------------------------------------------------------------------------- batch building


def test_build_sampling_batch_padding_and_seed_words():
    rows = [(SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1), 2**40 + 3, 11, [4, 9, 2]),
            (SamplingParams(top_k=1, temperature=2.0), 5, 0),
            (SamplingParams(top_k=500), 1, 1)]
    sb = build_sampling_batch(rows, 6, vocab=100)
    np.testing.assert_allclose(sb.temperature, [0.7, 0, 1, 0, 0, 0], rtol=1e-6)
    np.testing.assert_array_equal(sb.top_k, [5, 0, 0, 0, 0, 0])  # top_k >= vocab -> off
    np.testing.assert_array_equal(sb.seed[0], [256, 3])
    np.testing.assert_array_equal(sb.seed[3:], 0)
    assert sb.banned_RB.shape == (6, 4)  # 3 rounded up to a power of two
    np.testing.assert_array_equal(sb.banned_RB[0], [4, 9, 2, -1])
    np.testing.assert_array_equal(sb.banned_RB[1:], -1)
    assert not sb.all_greedy and sb.needs_filter
    only_greedy = build_sampling_batch([(SamplingParams(temperature=0), 1, 0)], 2, 100)
    assert only_greedy.all_greedy and only_greedy.banned_RB.shape == (2, 1)
    assert not build_sampling_batch([(SamplingParams(), 1, 0)], 2, 100).needs_filter
    with pytest.raises(ValueError, match="banned token ids"):
        build_sampling_batch([(SamplingParams(), 1, 0, [100])], 1, 100)
    with pytest.raises(ValueError, match="num_rows=1 < 2 rows"):
        build_sampling_batch([(SamplingParams(), 1, 0)] * 2, 1, 100)


def test_sampling_batch_of_columns_equals_padded_rows():
    """The engine's column form (sampler rows scattered among padding rows, params objects
    shared between rows) equals build_sampling_batch of the same rows with explicit greedy
    padding rows, and each row holds its own params' values (computed here row by row); bad
    seeds and positions are named."""
    from deepinfer_jax.sampling.sampler import sampling_batch_of

    rng = np.random.default_rng(3)
    shared = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9),
              SamplingParams(temperature=1.3, top_k=7, min_p=0.05), SamplingParams(top_k=300)]
    pad = (SamplingParams(temperature=0.0), 0, 0, ())
    for num_rows in (1, 5, 64):
        which = np.flatnonzero(rng.random(num_rows) < 0.6)
        cols = [(shared[int(rng.integers(4))] if rng.random() < 0.7 else
                 SamplingParams(temperature=float(rng.uniform(0.1, 2)), top_p=float(rng.uniform(0.5, 1))),
                 int(rng.integers(0, 2**64, dtype=np.uint64)), int(rng.integers(0, 2**31)),
                 rng.integers(0, 100, size=int(rng.integers(0, 3))).tolist()) for _ in which]
        rows = [pad] * num_rows
        for i, c in zip(which, cols):
            rows[i] = c
        want = build_sampling_batch(rows, num_rows, vocab=100, num_banned=4)
        got = sampling_batch_of(which, *(list(c) for c in zip(*cols)) if cols else ([], [], [], []),
                                num_rows, 100, num_banned=4)
        for f in ("temperature", "top_k", "top_p", "min_p", "seed", "position", "banned_RB"):
            np.testing.assert_array_equal(getattr(got, f), getattr(want, f), err_msg=f)
        assert (got.all_greedy, got.needs_filter) == (want.all_greedy, want.needs_filter)
        for r in range(num_rows):
            p, seed, pos, banned = rows[r]
            g = p.is_greedy
            assert got.temperature[r] == np.float32(0.0 if g else p.temperature)
            assert got.top_k[r] == (p.top_k if not g and 0 < p.top_k < 100 else 0)
            assert got.top_p[r] == np.float32(1.0 if g else p.top_p)
            assert got.min_p[r] == np.float32(0.0 if g else p.min_p)
            assert got.seed[r].tolist() == [seed >> 32, seed & 0xFFFFFFFF] and got.position[r] == pos
            assert got.banned_RB[r].tolist() == list(banned) + [-1] * (4 - len(banned))
    with pytest.raises(ValueError, match="seed=-1"):
        sampling_batch_of([0], [shared[0]], [-1], [0], [()], 2, 100)
    with pytest.raises(ValueError, match=r"row 1: position=-3"):
        sampling_batch_of([1], [shared[0]], [1], [-3], [()], 2, 100)


def test_seed_words_are_jax_key_words():
    for seed in (0, 5, 2**32 - 1):
        hi, lo = split_seed(seed)
        expected = jax.random.fold_in(jax.random.key(seed, impl="threefry2x32"), 17)
        got = row_keys(np.array([[hi, lo]], np.uint32), np.array([17], np.int32))[0]
        np.testing.assert_array_equal(jax.random.key_data(got), jax.random.key_data(expected))
    seed = 2**40 + 12345
    with jax.enable_x64(True):
        ref = jax.random.key_data(jax.random.key(seed, impl="threefry2x32"))
    np.testing.assert_array_equal(ref, split_seed(seed))


def test_min_tokens_banned_ids():
    p = SamplingParams(min_tokens=3, stop_token_ids=[7, 5])
    assert min_tokens_banned_ids(p, 0, [1]) == [1, 5, 7]
    assert min_tokens_banned_ids(p, 3, [1]) == []
    assert min_tokens_banned_ids(SamplingParams(min_tokens=3, ignore_eos=True), 1, [1]) == []


# --------------------------------------------------------------------------- greedy


def test_greedy_is_argmax_with_ties_to_lowest_id():
    logits = rand_logits(6, 50)
    logits[2, [40, 7, 13]] = logits[2].max() + 1.0  # three-way tie -> 7
    logits[4, [3, 1]] = logits[4].max() + 0.5       # tie -> 1
    rows = [(SamplingParams(temperature=0), i, i) for i in range(5)] + [(SamplingParams(top_k=1), 9, 9)]
    out = run(logits, rows)
    expected = logits.argmax(-1)
    assert expected[2] == 7 and expected[4] == 1
    np.testing.assert_array_equal(out.token_ids, expected)
    # Greedy rows mixed with sampled rows (the random path) give the same argmax.
    padded = np.concatenate([logits, rand_logits(2, 50)])
    mixed = run(padded, rows + [(SamplingParams(temperature=1.0), 3, 3)], num_rows=8)
    np.testing.assert_array_equal(mixed.token_ids[:6], expected)


# --------------------------------------------------------------------------- determinism


PARAM_CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6, top_k=4),
    SamplingParams(temperature=1.3, top_p=0.7),
    SamplingParams(temperature=0.9, min_p=0.2),
    SamplingParams(temperature=1.1, top_k=10, top_p=0.8, min_p=0.05),
    SamplingParams(temperature=0),
]


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["default", "batch_invariant"])
@pytest.mark.parametrize("params", PARAM_CASES, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
def test_row_alone_equals_row_in_batch(params, batch_invariant):
    V = 64
    target = rand_logits(1, V, scale=1.0)  # flat-ish so that sampling is genuinely random
    others = rand_logits(7, V)
    other_params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
                    for t, k, p, m in [(0.5, 3, 1.0, 0.0), (0, 0, 1.0, 0.0), (2.0, 0, 0.3, 0.0), (1.0, 0, 1.0, 0.5),
                                       (0.8, 20, 0.95, 0.01), (1.0, 0, 1.0, 0.0), (3.0, 2, 0.5, 0.1)]]
    for position in (0, 17, 4096):
        seed = 123456789012345
        kw = dict(batch_invariant=batch_invariant, num_logprobs=3)
        alone = run(target, [(params, seed, position)], **kw)
        batch_logits = np.concatenate([others[:5], target, others[5:]], axis=0)
        batch_rows = [(p, 1000 + i, position + i) for i, p in enumerate(other_params)]
        batch_rows.insert(5, (params, seed, position))
        in_batch = run(batch_logits, batch_rows, num_banned=4, **kw)
        padded = run(np.concatenate([target, others[:3]]), [(params, seed, position)], num_rows=4, **kw)
        assert in_batch.token_ids[5] == alone.token_ids[0] and padded.token_ids[0] == alone.token_ids[0]
        if batch_invariant:  # the logprobs too, bit for bit
            for f in ("logprob", "top_ids", "top_logprobs"):
                np.testing.assert_array_equal(getattr(in_batch, f)[5], getattr(alone, f)[0], err_msg=f)
                np.testing.assert_array_equal(getattr(padded, f)[0], getattr(alone, f)[0], err_msg=f)
        again = run(batch_logits, batch_rows, num_banned=4, **kw)
        np.testing.assert_array_equal(again.token_ids, in_batch.token_ids)


def test_seeds_and_positions_change_draws():
    V = 32
    logits = np.tile(rand_logits(1, V, scale=0.5), (200, 1))
    p = SamplingParams(temperature=1.0)
    draws = {seed: run(logits, [(p, seed, pos) for pos in range(200)]).token_ids for seed in (1, 2, 2**63 + 5)}
    assert (draws[1] != draws[2]).sum() > 100
    assert (draws[1] != draws[2**63 + 5]).sum() > 100
    assert len(set(draws[1].tolist())) > 10  # positions give different draws too


# --------------------------------------------------------------------------- distributions


def chi_square_bound(df: int, z: float = 4.75) -> float:
    """Upper quantile of chi-square(df) at one-sided normal z (4.75 -> tail p <= ~1e-6), by the
    Wilson-Hilferty approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def assert_matches(tokens: np.ndarray, probs: np.ndarray):
    """Counts of ``tokens`` fit ``probs``: no draw off the support, a chi-square below its
    1e-6 quantile, and a total-variation distance below 4x its expected size."""
    n = tokens.size
    counts = np.bincount(tokens, minlength=probs.size)
    support = probs > 0
    assert counts[~support].sum() == 0, f"drew tokens outside the support: {np.nonzero(counts * ~support)}"
    expected = n * probs[support]
    assert expected.min() >= 5
    chi2 = ((counts[support] - expected) ** 2 / expected).sum()
    assert chi2 < chi_square_bound(int(support.sum()) - 1), (chi2, counts, expected)
    tv = 0.5 * np.abs(counts / n - probs).sum()
    expected_tv = 0.5 * np.sqrt(2 / np.pi) * np.sqrt(probs * (1 - probs) / n).sum()
    assert tv < 4 * expected_tv, (tv, expected_tv)


def np_softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["default", "batch_invariant"])
def test_temperature_sampling_matches_softmax(batch_invariant):
    V, n, T = 8, 4000, 0.7
    row = rand_logits(1, V, scale=0.8)
    row[0] = np.clip(row[0], -1.0, 1.0)  # every token likely enough for the chi-square
    logits = np.tile(row, (n, 1))
    tokens = run(logits, [(SamplingParams(temperature=T), 42, pos) for pos in range(n)],
                 batch_invariant=batch_invariant).token_ids
    assert_matches(tokens, np_softmax(row[0].astype(np.float64) / T))


def np_filter_keep(scaled: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """Reference of vLLM's filters on one row of temperature-scaled logits (min-p, top-k, top-p)."""
    p = np_softmax(scaled.astype(np.float64))
    keep = p >= min_p * p.max()
    if 0 < top_k < scaled.size:
        keep &= scaled >= np.sort(scaled)[::-1][top_k - 1]
    q = np.where(keep, p, 0.0)
    q /= q.sum()
    if top_p < 1:
        order = np.argsort(-q, kind="stable")
        mass_before = np.cumsum(q[order]) - q[order]
        keep_p = np.zeros_like(keep)
        keep_p[order[mass_before < top_p]] = True
        keep &= keep_p
    return keep


def test_filters_match_numpy_reference():
    V = 300
    cases = [(0, 1.0, 0.1), (0, 1.0, 0.01), (0, 1.0, 0.5), (7, 1.0, 0.0), (0, 0.6, 0.0), (0, 0.95, 0.0),
             (20, 0.9, 0.02), (50, 0.5, 0.3), (0, 1.0, 0.0), (1, 1.0, 0.0), (V + 5, 1.0, 0.0), (3, 0.01, 0.9)]
    scaled = rand_logits(len(cases), V, scale=2.0)
    k, p, m = (np.array(c) for c in zip(*cases))
    got = np.asarray(apply_filters(scaled, k.astype(np.int32), p.astype(np.float32), m.astype(np.float32)))
    for i, (top_k, top_p, min_p) in enumerate(cases):
        keep = np_filter_keep(scaled[i], top_k, top_p, min_p)
        np.testing.assert_array_equal(np.isfinite(got[i]), keep, err_msg=f"case {cases[i]}")
        np.testing.assert_array_equal(got[i][keep], scaled[i][keep])


def test_top_k_never_outside_top_k():
    V, n = 16, 500
    row = rand_logits(1, V, scale=0.3)  # flat: without top-k many ids would appear
    tokens = run(np.tile(row, (n, 1)), [(SamplingParams(temperature=2.0, top_k=2), 3, pos) for pos in range(n)]).token_ids
    assert set(tokens.tolist()) == set(np.argsort(-row[0])[:2].tolist())


def test_top_p_keeps_expected_set():
    probs = np.array([0.05, 0.25, 0.1, 0.35, 0.05, 0.2])  # sorted: .35 (id 3), .25 (id 1), .2 ...
    logits = np.log(probs).astype(np.float32)[None]
    n = 600
    tokens = run(np.tile(logits, (n, 1)), [(SamplingParams(top_p=0.5), 8, pos) for pos in range(n)]).token_ids
    assert set(tokens.tolist()) == {1, 3}  # .35 < .5 so id 1 is needed; .35 + .25 >= .5 so no more
    tokens = run(np.tile(logits, (n, 1)), [(SamplingParams(top_p=0.3), 8, pos) for pos in range(n)]).token_ids
    assert set(tokens.tolist()) == {3}  # the top token alone already reaches .3


def test_filter_order_min_p_before_top_p_as_vllm():
    # p = [.5, .2, .05 x 6]. min_p=0.15 drops the .05s; renormalised, id 0 has .714 >= top_p=0.65,
    # so id 1 goes too. (Top-p before min-p would have kept {0, 1}.)
    probs = np.array([0.5, 0.2] + [0.05] * 6)
    logits = np.log(probs).astype(np.float32)[None]
    n = 300
    tokens = run(np.tile(logits, (n, 1)), [(SamplingParams(top_p=0.65, min_p=0.15), 8, pos) for pos in range(n)]).token_ids
    np.testing.assert_array_equal(tokens, 0)


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["default", "batch_invariant"])
def test_filtered_sampling_matches_renormalised_distribution(batch_invariant):
    V, n, T = 8, 4000, 1.2
    row = np.log(np.array([0.3, 0.02, 0.2, 0.15, 0.005, 0.12, 0.1, 0.105]))[None].astype(np.float32)
    params = SamplingParams(temperature=T, top_k=6, top_p=0.85, min_p=0.05)
    tokens = run(np.tile(row, (n, 1)), [(params, 77, pos) for pos in range(n)],
                 batch_invariant=batch_invariant).token_ids
    scaled = row[0].astype(np.float64) / T
    keep = np_filter_keep(scaled, params.top_k, params.top_p, params.min_p)
    assert 2 < keep.sum() < 6  # every filter does something here
    probs = np.where(keep, np_softmax(scaled), 0.0)
    assert_matches(tokens, probs / probs.sum())


# --------------------------------------------------------------------------- logprobs and bans


def test_logprobs_are_raw_and_top_n_sorted():
    R, V, N = 5, 200, 6
    logits = rand_logits(R, V)
    rows = [(SamplingParams(temperature=t, top_k=k), s, 3) for t, k, s in
            [(0, 0, 1), (1.0, 0, 2), (0.5, 5, 3), (2.0, 0, 4), (1.0, 0, 5)]]
    rows[4] = rows[4] + ([int(logits[4].argmax())],)  # banned: still shows in the raw top-N
    out = run(logits, rows, num_logprobs=N)
    ref = log_softmax(logits)
    np.testing.assert_allclose(out.logprob, ref[np.arange(R), out.token_ids], atol=1e-5)
    order = np.argsort(-ref, axis=-1, kind="stable")[:, :N]
    np.testing.assert_array_equal(out.top_ids, order)
    np.testing.assert_allclose(out.top_logprobs, np.take_along_axis(ref, order, -1), atol=1e-5)
    assert out.top_ids.dtype == np.int32 and out.top_logprobs.shape == (R, N)
    none = run(logits, rows, num_logprobs=0)
    assert none.top_ids.shape == (R, 0) and none.top_logprobs.shape == (R, 0)
    np.testing.assert_array_equal(none.token_ids, out.token_ids)


def test_banned_ids_never_sampled():
    V, n = 16, 400
    row = rand_logits(1, V, scale=2.0)
    top3 = np.argsort(-row[0])[:3].tolist()
    logits = np.tile(row, (n, 1))
    greedy = run(logits[:2], [(SamplingParams(temperature=0), 0, 0, top3), (SamplingParams(temperature=0), 0, 0, top3[:1])])
    np.testing.assert_array_equal(greedy.token_ids, [np.argsort(-row[0])[3], top3[1]])
    rows = [(SamplingParams(temperature=3.0), 5, pos, top3) for pos in range(n)]
    tokens = run(logits, rows).token_ids
    assert not set(tokens.tolist()) & set(top3)
    assert len(set(tokens.tolist())) > 5


def test_large_vocab_jits():
    V, N = 129280, 4
    logits = rand_logits(3, V)
    rows = [(SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.01), 11, 100, [5]),
            (SamplingParams(temperature=0), 0, 7),
            (SamplingParams(temperature=1.0, top_p=0.5), 12, 8)]
    out = run(logits, rows, num_logprobs=N)
    assert out.token_ids.shape == (3,) and out.top_ids.shape == (3, N)
    assert out.token_ids[1] == logits[1].argmax()
    assert out.token_ids[0] in set(np.argsort(-logits[0])[:40].tolist())
    np.testing.assert_allclose(out.logprob, log_softmax(logits)[np.arange(3), out.token_ids], atol=1e-4)


def test_sampling_batch_defaults_are_conservative():
    """A hand-built SamplingBatch (default hints) gives the same tokens as the builder's."""
    V = 40
    logits = rand_logits(3, V)
    rows = [(SamplingParams(temperature=0.7, top_p=0.8), 3, 4), (SamplingParams(temperature=0), 1, 1),
            (SamplingParams(), 9, 2)]
    sb = build_sampling_batch(rows, 3, V)
    plain = SamplingBatch(sb.temperature, sb.top_k, sb.top_p, sb.min_p, sb.seed, sb.position, sb.banned_RB)
    np.testing.assert_array_equal(np.asarray(sample(logits, plain).token_ids), np.asarray(sample(logits, sb).token_ids))
