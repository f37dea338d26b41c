"""Pallas indexer scoring + top-k kernels vs the jnp references (``indexer_topk_ref``).

CPU: interpret mode. ``-m device``: the same checks compiled for the GPU (Triton lowering).
Top-k must match exactly (on identical scores); scores may differ from the reference by one bf16
ulp at rare positions (f32 summation order of the dot and of the head sum; see the module doc).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import KERNEL_MODES, on_gpu
from deepinfer_jax.kernels_pallas import indexer_topk as K
from deepinfer_jax.kernels_pallas import indexer_topk_ref as R


MODES = KERNEL_MODES


def _inputs(rng, T, N, I, J, n_vis=None):
    q = jnp.asarray(rng.standard_normal((T, I, J)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((T, N, J)) * 0.5, jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((T, I)) * 0.2, jnp.bfloat16)
    if n_vis is None:
        n_vis = rng.integers(0, N + 1, size=T)
        n_vis[0], n_vis[-1] = N, 0
    return q, k, w, jnp.asarray(n_vis, jnp.int32)


def _score_slack(q, k, w):
    """Per-score bound on legitimate differences: one bf16 ulp of every head's product (its q.k
    may round the other way to bf16 when the f32 dot sums in another order) plus one of the sum."""
    s = jnp.einsum("tij,tnj->tin", q, k, preferred_element_type=jnp.float32)
    mag = jnp.sum(jnp.maximum(s, 0) * jnp.abs(w.astype(jnp.float32))[..., None], axis=1)
    return np.asarray(mag) * 2.0 ** -7


def _check_scores(got, want, slack):
    """Equal but for rare positions, and there within ``slack`` (+ one bf16 ulp of the result)."""
    g = np.asarray(got.astype(jnp.float32))
    r = np.asarray(want.astype(jnp.float32))
    assert g.shape == r.shape
    assert np.array_equal(np.isneginf(g), np.isneginf(r)), "visibility mask differs"
    fin = np.isfinite(r)
    assert np.isfinite(g[fin]).all()
    err = np.abs(g[fin] - r[fin])
    tol = slack[fin] + np.abs(r[fin]) * 2.0 ** -7 + 1e-30
    assert (err <= tol).all(), f"max excess {np.max(err - tol)}"
    if fin.any():
        assert (err > 0).mean() <= 0.05, f"{(err > 0).mean():.2%} of the scores differ"


def _check_topk(score, k, interpret, **kw):
    got = np.asarray(K.topk_positions(score, k, interpret=interpret, **kw))
    want = np.asarray(R.topk_positions_ref(score, k))
    assert got.shape == want.shape == (score.shape[0], k)
    bad = np.nonzero((got != want).any(axis=1))[0]
    assert bad.size == 0, f"rows {bad[:5]} differ: got {got[bad[0]][:16]} want {want[bad[0]][:16]}"


def _special_rows(N):
    """All -inf, all equal, +-0 only, +inf and ties, a ramp, a short visible prefix."""
    rows = np.full((6, N), -np.inf, np.float32)
    rows[1] = 1.5
    rows[2] = np.where(np.arange(N) % 3 == 0, -0.0, 0.0)
    rows[3, ::7] = 2.0
    rows[3, min(5, N - 1)] = np.inf
    rows[4] = np.linspace(-3, 3, N)
    rows[5, : min(40, N)] = np.linspace(1, 2, min(40, N))
    return jnp.asarray(rows, jnp.bfloat16)


def _quantize(score, levels, rng):
    """Few distinct values (heavy ties at the k-th score), -inf kept, both signs of zero present."""
    s = np.asarray(score.astype(jnp.float32))
    fin = np.isfinite(s)
    q = np.round(s * levels / (np.abs(s[fin]).max() + 1e-9)) if fin.any() else s
    q = np.where(fin, q, -np.inf).astype(np.float32)
    zeros = fin & (q == 0)
    q[zeros & (rng.random(q.shape) < 0.5)] = -0.0
    return jnp.asarray(q, jnp.bfloat16)


# ------------------------------------------------------------------------------------- scores


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("T,N,I,J", [(3, 16, 16, 32), (4, 100, 32, 64), (24, 1000, 16, 32), (2, 4096, 32, 128)])
def test_scores_match_reference(interpret, T, N, I, J):
    rng = np.random.default_rng([T, N, I, J])
    q, k, w, nv = _inputs(rng, T, N, I, J)
    got = K.indexer_scores(q, k, w, nv, interpret=interpret)
    _check_scores(got, R.indexer_scores_ref(q, k, w, nv), _score_slack(q, k, w))


@pytest.mark.parametrize("interpret", MODES)
def test_scores_pool_match_reference(interpret):
    """Keys read from the pool: token blocks (4 tokens a program) on one request row (the shared
    key-tile path, as in prefill) and straddling rows (each token its own keys); entries past
    every token's ``n_visible`` are garbage and must not be read."""
    rng = np.random.default_rng(7)
    T, N, I, J, R_, P = 10, 300, 16, 32, 3, 1024
    pool = jnp.asarray(rng.standard_normal((P, J)), jnp.bfloat16)
    entry = rng.permutation(P)[: R_ * N].reshape(R_, N)
    token_row = jnp.asarray([0, 0, 2, 1, 1, 1, 1, 1, 2, 2], jnp.int32)
    nv = np.array([N, 123, 7, 0, 40, 41, 0, 200, 299, 3])
    entry[1, 200:] = -(10 ** 6)  # row 1: tokens see at most 200 entries
    entry[2, 299:] = 10 ** 6  # row 2: at most 299
    q, _, w, nv = _inputs(rng, T, 1, I, J, n_vis=nv)
    entry = jnp.asarray(entry, jnp.int32)
    got = K.indexer_scores_pool(q, pool, entry, token_row, w, nv, interpret=interpret)
    keys = jnp.take(pool, entry, axis=0, mode="clip")[token_row]
    _check_scores(got, R.indexer_scores_pool_ref(q, pool, entry, token_row, w, nv), _score_slack(q, keys, w))


@pytest.mark.parametrize("interpret", MODES)
def test_scores_pool_coded_keys(interpret):
    """A pool of e5m2 codes + a power-of-two scale per entry (the model's index-key cache,
    ``quant.pack_index_keys``): the kernel's scores equal its scores on the decoded bf16 pool bit
    for bit (power-of-two scaling commutes with every rounding), and the reference's on the codes
    within the usual one-ulp slack. Keys are fp4-QDQ'd like the model's, with 32-blocks spread over
    12 binades and whole rows from 2^-20 to 2^20; both the shared-row and straddling paths run."""
    from deepinfer_jax.base import quant

    rng = np.random.default_rng(11)
    T, N, I, J, R_, P = 10, 300, 16, 64, 3, 1024
    raw = rng.standard_normal((P, J // 32, 32)) * np.exp2(rng.integers(-6, 7, (P, J // 32, 1)))
    raw = raw.reshape(P, J) * np.exp2(rng.integers(-20, 21, (P, 1)))
    keys = quant.act_quant_fp4(jnp.asarray(raw, jnp.bfloat16), 32, "ue8m0")
    codes, scale = quant.pack_index_keys(keys)
    assert codes.dtype == jnp.float8_e5m2 and bool(jnp.all(quant.unpack_index_keys(codes, scale) == keys))
    entry = jnp.asarray(rng.permutation(P)[: R_ * N].reshape(R_, N), jnp.int32)
    token_row = jnp.asarray([0, 0, 2, 1, 1, 1, 1, 1, 2, 2], jnp.int32)
    q, _, w, nv = _inputs(rng, T, 1, I, J, n_vis=np.array([N, 123, 7, 0, 40, 41, 0, 200, 299, 3]))
    args = (q, codes, entry, token_row, w, nv, scale)
    got = K.indexer_scores_pool(*args, interpret=interpret)
    got1 = K.indexer_scores_pool(*args, tokens_per_program=1, interpret=interpret)
    dec = K.indexer_scores_pool(q, keys, entry, token_row, w, nv, interpret=interpret)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(dec, np.float32))
    np.testing.assert_array_equal(np.asarray(got1, np.float32), np.asarray(dec, np.float32))
    gathered = jnp.take(keys, entry, axis=0, mode="clip")[token_row]
    _check_scores(got, R.indexer_scores_pool_ref(*args), _score_slack(q, gathered, w))
    np.testing.assert_array_equal(np.asarray(R.indexer_scores_pool_ref(*args), np.float32),
                                  np.asarray(R.indexer_scores_pool_ref(q, keys, entry, token_row, w, nv), np.float32))
    with pytest.raises(ValueError, match="coded pool"):
        K.indexer_scores_pool(q, keys, entry, token_row, w, nv, scale, interpret=interpret)


def test_one_byte_pools_beyond_int32_offsets_are_refused():
    """Pallas' Triton lowering (jax 0.11.2) addresses arrays of <= 2^32 bytes with signed 32-bit
    element offsets: a 1-byte pool of more than 2^31 elements would wrap (wrong scores on an H200).
    The kernel refuses it (``ops`` then runs the reference); bf16 pools switch to 64-bit offsets."""
    S = jax.ShapeDtypeStruct
    assert not K._i32_offsets_overflow(S((2 ** 24, 128), jnp.float8_e5m2))  # 2^31 elements: offsets fit
    assert K._i32_offsets_overflow(S((2 ** 24 + 1, 128), jnp.float8_e5m2))
    assert K._i32_offsets_overflow(S((2 ** 25, 128), jnp.float8_e5m2))  # exactly 2^32 bytes
    assert not K._i32_offsets_overflow(S((2 ** 25 + 1, 128), jnp.float8_e5m2))  # > 2^32 bytes: 64-bit
    assert not K._i32_offsets_overflow(S((2 ** 25, 128), jnp.bfloat16))


@pytest.mark.parametrize("coded,tb", [(False, 2), (True, 1), (True, 2)])
def test_lowers_to_triton_sm90(sm90_lowering, coded, tb):
    """Pallas -> Triton IR for an H200 on the CPU: interpret mode never lowers, and an op Triton's
    lowering rejects (an int constant cast to fp8, say) would otherwise first fail on the GPU."""
    T, N, I, J, P, S = 8, 256, 32, 128, 4096, jax.ShapeDtypeStruct
    pool = S((P, J), jnp.float8_e5m2 if coded else jnp.bfloat16)
    args = (S((T, I, J), jnp.bfloat16), pool, S((T, N), jnp.int32), S((T,), jnp.int32), S((T, I), jnp.bfloat16),
            S((T,), jnp.int32), S((P,), jnp.float32) if coded else None)
    fn = jax.jit(lambda *a: K.topk_positions(K.indexer_scores_pool(*a, tokens_per_program=tb), 64))
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 5  # scores + the four selection kernels


# -------------------------------------------------------------------------------------- top-k


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("N,k", [(16, 8), (100, 512), (1000, 8), (1000, 512), (4096, 64), (4096, 512)])
def test_topk_matches_reference(interpret, N, k):
    """Random scores (from the scoring reference) with per-row visibility incl. 0 and k > visible,
    plus rows with heavy ties (few distinct values, both zeros), candidate-style -inf blocks and
    special rows (all -inf, all equal, only +-0, +inf)."""
    rng = np.random.default_rng([N, k])
    T = 6
    nv = rng.integers(0, N + 1, size=T)
    nv[0], nv[1], nv[2] = N, 0, min(N, max(1, k // 2))
    q, kk, w, nv = _inputs(rng, T, N, 16, 32, n_vis=nv)
    score = R.indexer_scores_ref(q, kk, w, nv)
    tied = _quantize(score, 3, rng)
    blocks = np.repeat(rng.random((T, -(-N // 8))) < 0.4, 8, axis=1)[:, :N]
    masked = jnp.where(jnp.asarray(blocks), score, -jnp.inf)
    _check_topk(jnp.concatenate([score, tied, masked, _special_rows(N)]), k, interpret)


@pytest.mark.parametrize("interpret", MODES)
def test_topk_segments_and_ties(interpret):
    """Several compaction segments per row (small ``seg``), a coarse chunk bound and heavy ties:
    long candidate lists spread over the segments must be read back in order."""
    rng = np.random.default_rng(11)
    T, N, k = 4, 2000, 64
    q, kk, w, nv = _inputs(rng, T, N, 16, 32, n_vis=[N, N, 1500, 3])
    score = R.indexer_scores_ref(q, kk, w, nv)
    score = jnp.concatenate([score, _quantize(score, 2, rng), _special_rows(N)])
    _check_topk(score, k, interpret, seg=256, chunk=8)


@pytest.mark.parametrize("interpret", MODES)
def test_indexer_topk_end_to_end(interpret):
    rng = np.random.default_rng(5)
    q, kk, w, nv = _inputs(rng, 24, 1000, 16, 32)  # shapes shared with the tests above (compiles)
    got = np.asarray(K.indexer_topk(q, kk, w, nv, 8, interpret=interpret))
    score = K.indexer_scores(q, kk, w, nv, interpret=interpret)
    np.testing.assert_array_equal(got, np.asarray(R.topk_positions_ref(score, 8)))


def test_ops_dispatch_cpu_unchanged():
    """On CPU the ops still run the references (the GPU hook only loads on a GPU backend)."""
    from deepinfer_jax.kernels_pallas import ops

    if jax.default_backend() != "cpu":
        pytest.skip("CPU-only check")
    assert ops._pick("topk_positions", R.topk_positions_ref) is R.topk_positions_ref
    assert ops._pick("indexer_scores", R.indexer_scores_ref) is R.indexer_scores_ref


@pytest.mark.device
@pytest.mark.skipif(not on_gpu(), reason="needs a GPU")
def test_ops_dispatch_gpu_registered():
    from deepinfer_jax.kernels_pallas import ops

    assert ops._pick("topk_positions", R.topk_positions_ref) is K._topk_op
    assert ops._pick("indexer_scores", R.indexer_scores_ref) is K._scores_op


@pytest.mark.device
@pytest.mark.skipif(not on_gpu(), reason="needs a GPU")
@pytest.mark.parametrize("T,N", [(8, 16384), (4, 131072)])
def test_gpu_model_scale(T, N):
    """V4.1 shapes (I=32, J=128, k=512) on the GPU: exact top-k on our scores, scores within 1 ulp."""
    rng = np.random.default_rng([T, N])
    nv = rng.integers(1, N + 1, size=T)
    nv[0] = N
    q, kk, w, nv = _inputs(rng, T, N, 32, 128, n_vis=nv)
    score = K.indexer_scores(q, kk, w, nv)
    _check_scores(score, R.indexer_scores_ref(q, kk, w, nv), _score_slack(q, kk, w))
    _check_topk(score, 512, False)
