"""The dense per-row references (``kernels_pallas/full_rows_ref.py``, the training forward's
default) against the general gather references, on fresh random inputs in the training layout
(``B`` whole rows of ``L`` tokens; window pool = the slots' rings then this step's kv; compressed
pools of equal row blocks) at several shapes, with ragged validity (rows' early tokens see fewer
entries; index lists padded with -1).

Tolerances: the attention computes the same f32 arithmetic as ``sparse_attention_ref(...,
exact=False)`` in another summation order, and both round to bf16 at the same points, so outputs
agree to about one bf16 step (2^-8 relative); gradients likewise. The indexer scores are the same
arithmetic and compared exactly."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.base import quant
from deepinfer_jax.kernels_pallas import full_rows_ref, ops
from deepinfer_jax.kernels_pallas.indexer_topk_ref import indexer_scores_pool_ref
from deepinfer_jax.kernels_pallas.sparse_attention_ref import sparse_attention_ref


def _layout(rng, B, L, W, H, A, ratio, k):
    T = B * L
    q = jnp.asarray(rng.standard_normal((T, H, A)), jnp.bfloat16)
    ring = jnp.asarray(rng.standard_normal((B * W, A)), jnp.bfloat16)  # never addressed from position 0
    kv = jnp.asarray(rng.standard_normal((T, A)), jnp.bfloat16)
    pools, idxs = [jnp.concatenate([ring, kv])], []
    pos = np.tile(np.arange(L), B)
    row = np.repeat(np.arange(B), L)
    win = np.full((T, W), -1, np.int32)
    for t in range(T):
        p = np.arange(max(0, pos[t] - W + 1), pos[t] + 1)
        win[t, :len(p)] = B * W + row[t] * L + p
    idxs.append(jnp.asarray(win))
    if ratio:
        n = L // ratio
        pools.append(jnp.asarray(rng.standard_normal((B * n, A)), jnp.bfloat16))
        sel = np.full((T, k), -1, np.int32)
        for t in range(T):
            vis = (pos[t] + 1) // ratio
            pick = np.sort(rng.choice(vis, size=min(k, vis), replace=False)) if vis else np.zeros(0, int)
            sel[t, :len(pick)] = row[t] * n + pick
        idxs.append(jnp.asarray(sel))
    sink = jnp.asarray(rng.standard_normal(H), jnp.float32)
    return q, tuple(pools), tuple(idxs), sink


@pytest.mark.parametrize("B,L,W,H,A,ratio,k", [(2, 40, 8, 2, 32, 0, 0), (3, 32, 16, 4, 64, 2, 6),
                                               (2, 48, 8, 2, 32, 1, 40), (1, 80, 64, 2, 32, 1, 24)])
def test_sparse_attention_rows_matches_the_reference(B, L, W, H, A, ratio, k):
    rng = np.random.default_rng(B * 1000 + L + ratio)
    q, pools, idxs, sink = _layout(rng, B, L, W, H, A, ratio, k)
    scale = A ** -0.5
    ref = lambda q, pools: sparse_attention_ref(q, pools, idxs, sink, scale, exact=False)  # noqa: E731
    rows = lambda q, pools: full_rows_ref.sparse_attention_rows(q, pools, idxs, sink, scale, (B, L))  # noqa: E731
    a, b = ref(q, pools), rows(q, pools)
    np.testing.assert_allclose(np.asarray(b, np.float32), np.asarray(a, np.float32), rtol=8e-3, atol=1e-3)
    ct = jnp.asarray(rng.standard_normal(a.shape), jnp.bfloat16)
    ga = jax.vjp(ref, q, pools)[1](ct)
    gb = jax.vjp(rows, q, pools)[1](ct)
    for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        np.testing.assert_allclose(y, x, rtol=2e-2, atol=2e-2 * np.abs(x).max())


@pytest.mark.parametrize("B,L,I,J,N,scaled", [(2, 24, 2, 32, 24, False), (3, 16, 4, 32, 8, True),
                                              (1, 64, 4, 64, 32, False)])
def test_indexer_scores_rows_is_the_reference(B, L, I, J, N, scaled):
    rng = np.random.default_rng(N + L)
    T = B * L
    q = jnp.asarray(rng.standard_normal((T, I, J)), jnp.bfloat16)
    keys = jnp.asarray(rng.standard_normal((B * N, J)), jnp.bfloat16)
    scale = None
    if scaled:
        keys, scale = quant.pack_index_keys(keys)
    entry = jnp.asarray(np.arange(B * N).reshape(B, N), jnp.int32)
    row = jnp.asarray(np.repeat(np.arange(B), L), jnp.int32)
    w = jnp.asarray(rng.standard_normal((T, I)), jnp.bfloat16)
    nvis = jnp.asarray(np.minimum(np.tile(np.arange(L), B) // 2 + 1, N), jnp.int32)
    a = indexer_scores_pool_ref(q, keys, entry, row, w, nvis, scale)
    b = full_rows_ref.indexer_scores_pool_rows(q, keys, entry, row, w, nvis, scale, (B, L))
    np.testing.assert_array_equal(np.asarray(b, np.float32), np.asarray(a, np.float32))


def test_ops_route_to_the_rows_forms_only_inside_full_rows():
    rng = np.random.default_rng(0)
    B, L = 2, 40
    q, pools, idxs, sink = _layout(rng, B, L, 8, 2, 32, 1, 48)  # 56 > ... entries: exact and rows differ
    with ops.use_backend("reference"):
        plain = ops.sparse_attention(q, pools, idxs, sink, 0.2)
        with ops.full_rows(B, L):
            dense = ops.sparse_attention(q, pools, idxs, sink, 0.2)
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(sparse_attention_ref(q, pools, idxs, sink, 0.2)))
    np.testing.assert_array_equal(np.asarray(dense), np.asarray(
        full_rows_ref.sparse_attention_rows(q, pools, idxs, sink, 0.2, (B, L))))
    with pytest.raises(ValueError, match="batch\\*seq_len"):
        full_rows_ref.sparse_attention_rows(q, pools, idxs, sink, 0.2, (B, L + 1))
