"""Pure-jnp reference of the CSA2 indexer: scoring, candidate blocks and top-k selection.

Scores follow the reference's bf16 arithmetic:
``score[t, j] = bf16( sum_h bf16( relu(bf16(qI[t,h] . kI[j])) * w[t,h] ) )``, visible only for
``j < n_visible[t]`` (else -inf). Top-k returns positions sorted ascending, ``-1`` for unused
slots (fewer visible positions than k, or a position whose score is -inf, e.g. outside the
candidate blocks). Ties at the k-th score go to the lowest position (``lax.top_k`` order).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_jax.base import batch_invariant as bi
from deepinfer_jax.base import quant


def indexer_scores_ref(q_TIJ: jax.Array, k_TNJ: jax.Array, w_TI: jax.Array, n_visible_T: jax.Array) -> jax.Array:
    """bf16 scores ``[T, N]`` of each token's queries against the keys gathered for its request."""
    s = jnp.einsum("tij,tnj->tin", q_TIJ.astype(jnp.bfloat16), k_TNJ.astype(jnp.bfloat16),
                   preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    s = jnp.maximum(s, 0)
    prod = (s.astype(jnp.float32) * w_TI.astype(jnp.float32)[..., None]).astype(jnp.bfloat16)
    score = bi.row_sum(prod.astype(jnp.float32), axis=1).astype(jnp.bfloat16)
    n = score.shape[-1]
    visible = jnp.arange(n)[None, :] < n_visible_T[:, None]
    return jnp.where(visible, score, -jnp.inf)


def indexer_scores_pool_ref(q_TIJ: jax.Array, pool_PJ: jax.Array, entry_RN: jax.Array, token_row_T: jax.Array,
                            w_TI: jax.Array, n_visible_T: jax.Array, pool_scale_P: jax.Array | None = None) -> jax.Array:
    """``indexer_scores_ref`` with token ``t``'s keys ``pool_PJ[entry_RN[token_row_T[t]]]`` (gathered here).
    With ``pool_scale_P`` the pool holds codes and the key of entry p is ``pool_PJ[p] * pool_scale_P[p]``
    (``quant.pack_index_keys``)."""
    k_RNJ = jnp.take(pool_PJ, entry_RN, axis=0, mode="clip")
    if pool_scale_P is not None:
        k_RNJ = quant.unpack_index_keys(k_RNJ, jnp.take(pool_scale_P, entry_RN, axis=0, mode="clip"))
    return indexer_scores_ref(q_TIJ, k_RNJ[token_row_T], w_TI, n_visible_T)


def candidate_blocks_ref(score_TN: jax.Array, n_visible_T: jax.Array, topk_blocks: int, block: int) -> jax.Array:
    """Bool mask ``[T, N]`` of the positions inside the ``topk_blocks`` best blocks (block score =
    max over its positions); the block holding the newest visible position is always kept."""
    T, n = score_TN.shape
    nb = -(-n // block)
    s = jnp.pad(score_TN.astype(jnp.float32), ((0, 0), (0, nb * block - n)), constant_values=-jnp.inf)
    bs = jnp.max(s.reshape(T, nb, block), axis=-1)
    last = jnp.floor_divide(n_visible_T - 1, block)
    bs = jnp.where(jnp.arange(nb)[None, :] == last[:, None], jnp.inf, bs)
    vals, ids = jax.lax.top_k(bs, min(topk_blocks, nb))
    keep = jnp.zeros((T, nb), bool).at[jnp.arange(T)[:, None], ids].set(vals > -jnp.inf)
    return jnp.repeat(keep, block, axis=-1)[:, :n]


def topk_positions_ref(score_TN: jax.Array, k: int) -> jax.Array:
    """Top-``k`` positions by score, sorted ascending, ``-1`` where the score is -inf."""
    T, n = score_TN.shape
    if n < k:
        score_TN = jnp.pad(score_TN, ((0, 0), (0, k - n)), constant_values=-jnp.inf)
    vals, ids = jax.lax.top_k(score_TN.astype(jnp.float32), k)
    big = jnp.iinfo(jnp.int32).max
    ids = jnp.sort(jnp.where(vals > -jnp.inf, ids, big), axis=-1)
    return jnp.where(ids == big, -1, ids).astype(jnp.int32)
