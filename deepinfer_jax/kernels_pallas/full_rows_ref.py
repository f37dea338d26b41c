"""Dense per-row forms of two gather-based references, for steps whose tokens are ``B`` whole
sequences of ``L`` tokens from position 0 (the training layout, ``training/forward.py``).

The references gather each token's keys (``sparse_attention_ref``: ``[T, M, A]``;
``indexer_scores_pool_ref``: ``[T, N, J]``), which is the general ragged form but costly when
differentiated: the gathers' gradients are scatter-adds of every token's copy back into the
pool. Here each row's keys are a dense block and the selection is a mask:

* ``sparse_attention_rows``: scores of each row's queries against all keys its row can address
  in each pool (pool 0, the window pool ``[ring entries, this step's kv]``: the row's ``L`` new
  entries; each further pool, a compressed cache whose row ``b`` owns entries ``b*n .. b*n+n-1``),
  masked to the entries the token's index lists name. The softmax is the reference's with
  ``exact=False`` (probabilities rounded to bf16 against the final max; differs from the
  blockwise ``exact=True`` only when a token attends to more than 64 entries) and bf16 x bf16
  products accumulated in f32 (the reference multiplies the same values in f32: the products
  are exact either way, only the summation order differs).
* ``indexer_scores_pool_rows``: the same arithmetic as ``indexer_scores_pool_ref`` with the row's
  keys used in place of per-token copies.

The layout is not checked inside the trace: an index outside its row's block is dropped; the
tests compare these against the references on the training forward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_jax.base import kv_codes, quant


def _pool_rows(pool_NA: jax.Array, first: bool, B: int, L: int) -> tuple[int, int]:
    """``(base, n)``: row ``b`` addresses ``pool[base + b*n : base + (b+1)*n]``."""
    N = pool_NA.shape[0]
    if first:
        if N < B * L:
            raise ValueError(f"full rows: window pool of {N} entries < batch*seq_len = {B * L}")
        return N - B * L, L
    if N % B:
        raise ValueError(f"full rows: compressed pool of {N} entries is not {B} equal row blocks")
    return 0, N // B


def sparse_attention_rows(q_THA: jax.Array, pools: tuple[jax.Array, ...], idxs: tuple[jax.Array, ...],
                          sink_H: jax.Array, scale: float, rows: tuple[int, int]) -> jax.Array:
    B, L = rows
    T, H, A = q_THA.shape
    if T != B * L:
        raise ValueError(f"full rows: {T} tokens != batch*seq_len = {B}*{L}")
    row_T = jnp.arange(T) // L
    q = q_THA.reshape(B, L, H, A).astype(jnp.bfloat16)
    pools = tuple(kv_codes.unpack(p) for p in pools)  # packed caches: decoded whole (training sizes)
    scores, kvs = [], []
    for p, (pool, idx) in enumerate(zip(pools, idxs)):
        base, n = _pool_rows(pool, p == 0, B, L)
        kv_BNA = pool[base:base + B * n].reshape(B, n, A).astype(jnp.bfloat16)
        local = idx - (base + row_T[:, None] * n)
        ok = (idx >= 0) & (local >= 0) & (local < n)
        mask = jnp.zeros((T, n), bool).at[jnp.arange(T)[:, None], jnp.where(ok, local, n)].set(True, mode="drop")
        s = jnp.einsum("blha,bna->blhn", q, kv_BNA, preferred_element_type=jnp.float32) * jnp.float32(scale)
        scores.append(jnp.where(mask.reshape(B, L, 1, n), s, -jnp.inf))
        kvs.append(kv_BNA)
    s = jnp.concatenate(scores, axis=-1)
    kv = jnp.concatenate(kvs, axis=1)
    m = jnp.maximum(jnp.max(s, axis=-1), jnp.float32(-1e30))
    p = jnp.exp(s - m[..., None])
    denom = jnp.sum(p, axis=-1) + jnp.exp(sink_H.astype(jnp.float32)[None, None, :] - m)
    o = jnp.einsum("blhn,bna->blha", p.astype(jnp.bfloat16), kv, preferred_element_type=jnp.float32)
    return (o / denom[..., None]).astype(jnp.bfloat16).reshape(T, H, A)


def indexer_scores_pool_rows(q_TIJ: jax.Array, pool_PJ: jax.Array, entry_RN: jax.Array, token_row_T: jax.Array,
                             w_TI: jax.Array, n_visible_T: jax.Array, pool_scale_P, rows: tuple[int, int]) -> jax.Array:
    B, L = rows
    T, I, J = q_TIJ.shape
    if T != B * L or entry_RN.shape[0] < B:
        raise ValueError(f"full rows: {T} tokens / {entry_RN.shape[0]} rows != batch*seq_len = {B}*{L}")
    k_BNJ = jnp.take(pool_PJ, entry_RN[:B], axis=0, mode="clip")
    if pool_scale_P is not None:
        k_BNJ = quant.unpack_index_keys(k_BNJ, jnp.take(pool_scale_P, entry_RN[:B], axis=0, mode="clip"))
    s = jnp.einsum("blij,bnj->blin", q_TIJ.reshape(B, L, I, J).astype(jnp.bfloat16), k_BNJ.astype(jnp.bfloat16),
                   preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    s = jnp.maximum(s, 0)
    prod = (s.astype(jnp.float32) * w_TI.reshape(B, L, I).astype(jnp.float32)[..., None]).astype(jnp.bfloat16)
    score = jnp.sum(prod.astype(jnp.float32), axis=2).astype(jnp.bfloat16).reshape(T, -1)
    n = score.shape[-1]
    visible = jnp.arange(n)[None, :] < n_visible_T[:, None]
    return jnp.where(visible, score, -jnp.inf)
