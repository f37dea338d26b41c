"""The indexers' objective (DeepSeek's sparse-attention indexer training): at each index layer,
the KL divergence from the layer's own attention over the compressed entries its KV source has
completed (softmax per head over the visible entries, summed over heads and renormalised; no
gradient) to the softmax of the indexer's scores over the same entries. The indexer's inputs are
cut from the gradient (``layers/attention/indexer.py``), so this trains the indexer alone and
the next-token loss trains the rest.

Reads the taps of the training forward (``train_forward(..., taps)``): ``attn{l}_q`` (the
layer's RoPE'd queries ``[T, H, A]``) and ``index{l}_scores`` (``[T, N]``, the row's addressable
entries in order), and the filled cache's compressed KV of the layer's source. In the training
layout row ``b`` owns blocks ``b*per .. (b+1)*per - 1`` (``forward.py``), so the source's cache
reshaped to ``[B, N, A]`` is every row's entries in the indexer's order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def indexer_layers(cfg) -> tuple[int, ...]:
    return tuple(cfg.index_source_layer_ids)


def indexer_kl(cfg, taps: dict, cache, batch: int, seq_len: int) -> jax.Array:
    """Mean over index layers and query positions that see at least one entry of
    ``KL(attention || indexer)``; 0 without index layers."""
    B, L = batch, seq_len
    pos_L = jnp.arange(L)
    total, n_layers = jnp.float32(0.0), 0
    for layer in indexer_layers(cfg):
        ratio = cfg.compress_ratios[layer]
        src = cfg.kv_source_layer_ids.index(cfg.kv_source_of(layer))
        q_BLHA = jax.lax.stop_gradient(taps[f"attn{layer}_q"]).astype(jnp.float32)
        q_BLHA = q_BLHA.reshape(B, L, *q_BLHA.shape[1:])
        ckv = jax.lax.stop_gradient(cache.comp_kv[src]).astype(jnp.float32)
        ckv_BNA = ckv.reshape(B, -1, ckv.shape[-1])
        score_BLN = taps[f"index{layer}_scores"].astype(jnp.float32).reshape(B, L, -1)
        N = ckv_BNA.shape[1]
        vis_LN = jnp.arange(N)[None, :] < ((pos_L + 1) // ratio)[:, None]
        scale = q_BLHA.shape[-1] ** -0.5
        att = jnp.einsum("blha,bna->blhn", q_BLHA, ckv_BNA) * scale
        att = jnp.where(vis_LN[None, :, None, :], att, -jnp.inf)
        has_L = vis_LN.any(axis=1)
        att = jax.nn.softmax(jnp.where(has_L[None, :, None, None], att, 0.0), axis=-1).sum(axis=2)
        target_BLN = jax.lax.stop_gradient(att / jnp.maximum(att.sum(-1, keepdims=True), 1e-20))
        logq = jax.nn.log_softmax(jnp.where(vis_LN[None], score_BLN, -jnp.inf), axis=-1)
        kl = jnp.where(vis_LN[None] & (target_BLN > 0),
                       target_BLN * (jnp.log(jnp.maximum(target_BLN, 1e-30)) - logq), 0.0).sum(-1)
        total = total + jnp.sum(kl * has_L[None]) / jnp.maximum(B * jnp.sum(has_L), 1)
        n_layers += 1
    return total / max(n_layers, 1)
