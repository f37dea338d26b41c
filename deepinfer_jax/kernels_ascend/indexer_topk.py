"""Indexer scores, candidate blocks and top-k through the ``deepinfer_indexer_*`` /
``deepinfer_candidate_blocks`` / ``deepinfer_topk_positions`` custom calls."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def indexer_scores(q_TIJ, k_TNJ, w_TI, n_visible_T) -> jax.Array:
    """bf16 ``[T, N]`` (``indexer_scores_ref``)."""
    T, N = q_TIJ.shape[0], k_TNJ.shape[1]
    call = jax.ffi.ffi_call("deepinfer_indexer_scores", jax.ShapeDtypeStruct((T, N), jnp.bfloat16),
                            vmap_method="sequential")
    return call(q_TIJ.astype(jnp.bfloat16), k_TNJ.astype(jnp.bfloat16), w_TI.astype(jnp.float32),
                n_visible_T.astype(jnp.int32))


def indexer_scores_pool(q_TIJ, pool_PJ, entry_RN, token_row_T, w_TI, n_visible_T, pool_scale_P=None) -> jax.Array:
    """``indexer_scores_pool_ref`` with the keys read in place from ``pool_PJ`` (bf16, or e5m2
    codes with ``pool_scale_P``)."""
    T, N = q_TIJ.shape[0], entry_RN.shape[1]
    if pool_PJ.dtype not in (jnp.bfloat16, jnp.float8_e5m2):
        pool_PJ = pool_PJ.astype(jnp.bfloat16)
    has_scale = pool_scale_P is not None
    scale = pool_scale_P.astype(jnp.float32) if has_scale else jnp.ones((1,), jnp.float32)
    call = jax.ffi.ffi_call("deepinfer_indexer_scores_pool", jax.ShapeDtypeStruct((T, N), jnp.bfloat16),
                            vmap_method="sequential")
    return call(q_TIJ.astype(jnp.bfloat16), pool_PJ, entry_RN.astype(jnp.int32), token_row_T.astype(jnp.int32),
                w_TI.astype(jnp.float32), n_visible_T.astype(jnp.int32), scale, has_scale=np.int64(has_scale))


def candidate_blocks(score_TN, n_visible_T, topk_blocks: int, block: int) -> jax.Array:
    """Bool ``[T, N]`` mask of the best ``topk_blocks`` blocks (``candidate_blocks_ref``)."""
    call = jax.ffi.ffi_call("deepinfer_candidate_blocks", jax.ShapeDtypeStruct(score_TN.shape, jnp.bool_),
                            vmap_method="sequential")
    return call(score_TN.astype(jnp.float32), n_visible_T.astype(jnp.int32), topk_blocks=np.int64(topk_blocks),
                block=np.int64(block))


def topk_positions(score_TN, k: int) -> jax.Array:
    """int32 ``[T, k]``: top-k positions ascending, -1 where unused (``topk_positions_ref``)."""
    call = jax.ffi.ffi_call("deepinfer_topk_positions", jax.ShapeDtypeStruct((score_TN.shape[0], k), jnp.int32),
                            vmap_method="sequential")
    return call(score_TN.astype(jnp.float32), k=np.int64(k))
