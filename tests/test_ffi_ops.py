"""kernels_ascend's FFI custom calls (the C++ CPU build) against the jnp references.

Tolerances, by what can differ: the C++ targets reproduce every rounding step of the references
(bf16 casts, fp8 QDQ, fp4/fp8 dequantisation, the 64-entry running max), so the only sources of
difference are the fp32 summation order of dot products (8 partial sums here, XLA's own order
there) and libm's ``exp`` vs XLA's. Either moves an fp32 value by a few ulps; after a bf16 cast
that is at most one bf16 ulp (2^-8 relative) on an element whose fp32 value sat near a rounding
boundary, and downstream roundings (a bf16 probability, an fp8 QDQ step of 2^-3 relative) can
carry that one flip further. So the bf16 outputs are held to "equal on almost all elements, and
a few steps of the rounding they pass through on the rest", fp32 Sinkhorn to a few fp32 ulps,
and the discrete ops (candidate blocks, top-k, given equal scores) to bit equality.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ffi_cases import attention_case, indexer_case, moe_case, pool_case
from deepinfer_jax.base import quant
from deepinfer_jax.kernels_pallas import indexer_topk_ref, moe_gmm_ref, sinkhorn_ref, sparse_attention_ref


@pytest.fixture(scope="module")
def K():
    from deepinfer_jax.kernels_ascend import kernels, library

    try:
        return kernels.kernels_for("cpu")
    except library.FfiUnavailable as e:
        pytest.fail(str(e))


def f32(x):
    return np.asarray(x, np.float32)


def close_bf16(ours, ref, rel_of_max: float, max_mismatch: float, what: str):
    """Equal but on ``max_mismatch`` of the elements; those within ``rel_of_max`` of max |ref|."""
    o, r = f32(ours), f32(ref)
    assert o.shape == r.shape and o.dtype == r.dtype
    fin = np.isfinite(r)
    assert (np.isfinite(o) == fin).all() and (o[~fin] == r[~fin]).all(), f"{what}: non-finite pattern differs"
    d = np.abs(o[fin] - r[fin])
    scale = np.abs(r[fin]).max() if fin.any() else 1.0
    assert d.max(initial=0) <= rel_of_max * scale, f"{what}: max |diff| {d.max():.4g} vs max |ref| {scale:.4g}"
    assert (d > 0).mean() <= max_mismatch, f"{what}: {(d > 0).mean():.2%} of elements differ"


@pytest.mark.parametrize("n,shape", [(19, (7, 4, 4)), (1, (1, 4, 4)), (5, (3, 2, 5, 5))])
def test_sinkhorn(K, n, shape):
    c = jnp.asarray(np.random.default_rng(n).random(shape) + 0.01, jnp.float32)
    ours = jax.jit(K["sinkhorn_iterate"], static_argnums=(1, 2))(c, n, 1e-6)
    np.testing.assert_allclose(ours, sinkhorn_ref.sinkhorn_iterate_ref(c, n, 1e-6), rtol=1e-5, atol=1e-7)


# widths (one per pool) with M below, at and across the 64-entry blocks; T = 1 and odd T
@pytest.mark.parametrize("T,H,A,widths,rows,exact", [
    (1, 1, 32, (1,), (5,), True),
    (5, 4, 64, (63,), (40,), True),
    (3, 8, 64, (65, 9), (100, 13), True),
    (4, 2, 48, (130, 7), (50, 20), False),
])
def test_sparse_attention(K, T, H, A, widths, rows, exact):
    q, pools, idxs, sink = attention_case(np.random.default_rng(T * 100 + sum(widths)), T, H, A, widths, rows)
    scale = A ** -0.5
    fn = jax.jit(lambda *a: K["sparse_attention"](*a, scale, exact))
    ours = fn(q, pools, idxs, sink)
    ref = sparse_attention_ref.sparse_attention_ref(q, pools, idxs, sink, scale, exact)
    close_bf16(ours, ref, 2 ** -6, 0.01, "sparse_attention")


def test_sparse_attention_all_unused_rows_give_zeros(K):
    q, pools, idxs, sink = attention_case(np.random.default_rng(1), 2, 2, 32, (10,), (8,))
    idxs = (jnp.full_like(idxs[0], -1),)
    ours = K["sparse_attention"](q, pools, idxs, sink, 0.2)
    np.testing.assert_array_equal(f32(ours), f32(sparse_attention_ref.sparse_attention_ref(q, pools, idxs, sink, 0.2)))


def test_sparse_attention_vmap(K):
    cases = [attention_case(np.random.default_rng(s), 3, 2, 32, (70,), (30,)) for s in range(3)]
    q, pools, idxs, sink = (jnp.stack([c[0] for c in cases]), (jnp.stack([c[1][0] for c in cases]),),
                            (jnp.stack([c[2][0] for c in cases]),), jnp.stack([c[3] for c in cases]))
    ours = jax.vmap(lambda *a: K["sparse_attention"](*a, 0.15))(q, pools, idxs, sink)
    ref = jax.vmap(lambda *a: sparse_attention_ref.sparse_attention_ref(*a, 0.15))(q, pools, idxs, sink)
    close_bf16(ours, ref, 2 ** -6, 0.01, "vmap sparse_attention")


def test_sinkhorn_vmap(K):
    c = jnp.asarray(np.random.default_rng(4).random((3, 5, 4, 4)) + 0.01, jnp.float32)
    ours = jax.vmap(lambda x: K["sinkhorn_iterate"](x, 7, 1e-6))(c)
    np.testing.assert_allclose(ours, sinkhorn_ref.sinkhorn_iterate_ref(c, 7, 1e-6), rtol=1e-5, atol=1e-7)


# scores: one bf16 flip of a (q . k) term moves its relu * w product and the bf16 sum by an ulp
@pytest.mark.parametrize("T,I,N,J", [(1, 1, 1, 32), (5, 4, 37, 64), (3, 8, 130, 128)])
def test_indexer_scores_and_selection(K, T, I, N, J):
    q, k, w, n_vis = indexer_case(np.random.default_rng(N), T, I, N, J)
    ours = jax.jit(K["indexer_scores"])(q, k, w, n_vis)
    ref = indexer_topk_ref.indexer_scores_ref(q, k, w, n_vis)
    close_bf16(ours, ref, 2 ** -5, 0.02, "indexer_scores")
    for kk in (1, 8, N, N + 3):  # k below, at and above the visible count
        np.testing.assert_array_equal(jax.jit(K["topk_positions"], static_argnums=1)(ref, kk),
                                      indexer_topk_ref.topk_positions_ref(ref, kk))
    for blocks, block in ((1, 8), (2, 16), (50, 4)):
        np.testing.assert_array_equal(K["candidate_blocks"](ref, n_vis, blocks, block),
                                      indexer_topk_ref.candidate_blocks_ref(ref, n_vis, blocks, block))


def test_topk_ties_go_to_the_lowest_position(K):
    s = jnp.asarray([[1, 2, 2, 2, 0, 2, -jnp.inf, 3], [-jnp.inf] * 8], jnp.float32)
    np.testing.assert_array_equal(K["topk_positions"](s, 3), indexer_topk_ref.topk_positions_ref(s, 3))
    np.testing.assert_array_equal(K["topk_positions"](s, 3), [[1, 2, 7], [-1, -1, -1]])


@pytest.mark.parametrize("codes", [False, True])
@pytest.mark.parametrize("T,I,P,R,N,J", [(1, 2, 5, 1, 3, 32), (6, 4, 200, 3, 45, 64)])
def test_indexer_scores_pool(K, codes, T, I, P, R, N, J):
    q, pool, entry, row, w, n_vis = pool_case(np.random.default_rng(P + codes), T, I, P, R, N, J)
    scale = None
    if codes:  # the fp8 index-key cache: fp4-QDQ'd keys packed as e5m2 codes + row scales
        pool, scale = quant.pack_index_keys(quant.act_quant_fp4(pool, 32, "ue8m0"))
    ours = jax.jit(K["indexer_scores_pool"])(q, pool, entry, row, w, n_vis, scale)
    ref = indexer_topk_ref.indexer_scores_pool_ref(q, pool, entry, row, w, n_vis, scale)
    close_bf16(ours, ref, 2 ** -5, 0.02, "indexer_scores_pool")


# MoE: a bf16 flip in gate/up can move one fp8 QDQ step (2^-3 relative) of h, and through W2
# every output of that row by a small share of it
@pytest.mark.parametrize("fmt", ["fp8", "fp4", "bf16"])
@pytest.mark.parametrize("T,X,D,F,E", [(1, 1, 32, 32, 1), (7, 3, 96, 64, 5)])
def test_moe_experts(K, fmt, T, X, D, F, E):
    x, idx, g, w1, w2, w3 = moe_case(np.random.default_rng(T + E), fmt, T, X, D, F, E)
    for limit in (0.0, 7.0):
        fn = jax.jit(lambda x, i, g, w1, w2, w3: K["moe_experts"](x, i, g, w1, w2, w3, fmt, limit, E))
        ours = fn(x, idx, g, w1, w2, w3)
        ref = moe_gmm_ref.moe_experts_ref(x, idx, g, w1, w2, w3, fmt, limit, E)
        close_bf16(ours, ref, 2 ** -4, 0.05, f"moe_experts {fmt}")
        out_of_range = (idx < 0) | (idx >= E)
        assert (f32(ours)[np.asarray(out_of_range)] == 0).all()
