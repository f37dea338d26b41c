"""Pure-jnp reference of sparse MQA attention with an attention sink.

Every query token t attends to M gathered KV entries (one latent per entry, used as both key
and value; ``-1`` = unused) of one or more KV pools, with all H heads sharing them:

    s[t,h,m] = q[t,h] . kv[idx[t,m]] * scale
    o[t,h]   = sum_m p[t,h,m] kv[idx[t,m]],   p = exp(s) / (exp(sink_h) + sum_m exp(s))

A pool is a ``[N, A]`` array or a ``kv_codes.PackedPool`` (the packed caches): only the gathered
rows are decoded, to the values the bf16 cache would hold.

``exact=True`` reproduces the reference kernel's rounding: an online softmax over blocks of 64
entries whose probabilities are rounded to bf16 relative to the *running* max before the PV
product (the denominator keeps fp32 probabilities). ``exact=False`` rounds the same way but
against the final max (one pass; differs from exact only when M > 64).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_jax.base import batch_invariant as bi
from deepinfer_jax.base import kv_codes

BLOCK = 64  # entries per online-softmax step of the reference kernel


def gather_kv(pools: tuple, idxs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
    """Gather ``[T, M, A]`` bf16 entries (M = sum of the index widths, in order) and the valid mask."""
    kvs, valid = [], []
    for pool_NA, idx_TM in zip(pools, idxs):
        ok = idx_TM >= 0
        kvs.append(kv_codes.take_rows(pool_NA, jnp.where(ok, idx_TM, 0)))
        valid.append(ok)
    return jnp.concatenate(kvs, axis=1), jnp.concatenate(valid, axis=1)


def sparse_attention_ref(q_THA: jax.Array, pools: tuple[jax.Array, ...], idxs: tuple[jax.Array, ...],
                         sink_H: jax.Array, scale: float, exact: bool = True) -> jax.Array:
    kv_TMA, valid_TM = gather_kv(pools, idxs)
    kv_TMA = jnp.where(valid_TM[..., None], kv_TMA, 0).astype(jnp.float32)
    T, M, _ = kv_TMA.shape
    s = jnp.einsum("tha,tma->thm", q_THA.astype(jnp.float32), kv_TMA, precision=jax.lax.Precision.HIGHEST)
    s = jnp.where(valid_TM[:, None, :], s, -jnp.inf) * jnp.float32(scale)
    if exact:
        nb = -(-M // BLOCK)
        pad = nb * BLOCK - M
        s_b = jnp.pad(s, ((0, 0), (0, 0), (0, pad)), constant_values=-jnp.inf).reshape(T, s.shape[1], nb, BLOCK)
        run_max = jnp.maximum(jax.lax.cummax(jnp.max(s_b, axis=-1), axis=2), jnp.float32(-1e30))  # [T,H,nb]
        m_final = run_max[..., -1]
        m_entry = jnp.repeat(run_max, BLOCK, axis=-1)[..., :M]
    else:
        m_final = jnp.maximum(jnp.max(s, axis=-1), jnp.float32(-1e30))
        m_entry = m_final[..., None]
    p = jnp.exp(s - m_entry)  # fp32, relative to the running max
    rescale = jnp.exp(m_entry - m_final[..., None])
    denom = bi.row_sum(p * rescale, axis=-1) + jnp.exp(sink_H.astype(jnp.float32) - m_final)
    p_bf = p.astype(jnp.bfloat16).astype(jnp.float32) * rescale
    o = jnp.einsum("thm,tma->tha", p_bf, kv_TMA, precision=jax.lax.Precision.HIGHEST)
    return (o / denom[..., None]).astype(jnp.bfloat16)
