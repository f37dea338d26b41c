"""Indexer of an index-source layer: picks ``index_topk`` compressed positions per query.

Queries ``qI = wq_b(q_lora activation)`` (RoPE, fp4 QDQ), head weights
``w = weights_proj(x) / sqrt(index_dim * index_heads)``; keys are the index-key cache of the
layer's KV source (written by the source, from the compressor latent before RoPE:
``k_norm(wk(latent))``, RoPE at the group's first position, fp4 QDQ; stored as bf16, or with
``CacheConfig.index_key_dtype="fp8"`` as e5m2 codes plus a power-of-two scale per key,
``quant.pack_index_keys``, which holds those values exactly). Every index layer scores
against the keys of all groups its KV source has completed, at every step. The candidate source
publishes the best ``candidate_topk_blocks`` blocks; later index layers mask the rest.

The indexer learns from its own objective only (as in DeepSeek's sparse attention: a KL
divergence to the main attention's distribution, ``training/indexer_loss.py``): its inputs are
cut from the gradient (``stop_gradient``, a no-op at inference), and its raw scores are tapped
as ``index{layer}_scores`` for that loss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from deepinfer_jax.kernels_pallas import ops
from deepinfer_jax.base import quant
from deepinfer_jax.layers.attention.kv_index import DROP, StepContext
from deepinfer_jax.layers.linear import Linear
from deepinfer_jax.layers.norms import RMSNorm
from deepinfer_jax.layers.rope import apply_rope


class Indexer(nnx.Module):
    def __init__(self, cfg, layer: int, dense_fmt: str):
        self.owns_k = layer in cfg.kv_source_layer_ids
        self.is_candidate_source = layer == cfg.candidate_source_layer_id
        self.uses_candidates = cfg.uses_candidates(layer)
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.topk = cfg.index_topk
        self.cand_blocks, self.cand_block = cfg.candidate_topk_blocks, cfg.candidate_block_size
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, dense_fmt)
        self.weights_proj = Linear(cfg.hidden_size, self.n_heads, "bf16")
        if self.owns_k:
            self.wk = Linear(cfg.head_dim, self.head_dim, "bf16")
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def write_keys(self, ctx: StepContext, latent_TA, done_T, src: int, ratio: int, freqs: np.ndarray) -> None:
        """Index keys of the groups completed in this step -> the source's index-key cache."""
        k = self.k_norm(self.wk(jax.lax.stop_gradient(latent_TA)))
        k = quant.act_quant_fp4(apply_rope(k, ctx.pos - (ratio - 1), freqs), 32, "ue8m0")
        cache = ctx.cache["index_k"][src]
        flat = cache.reshape(-1, cache.shape[-1])
        dst = jnp.where(done_T & (ctx.pos >= ctx.cache_start_T), ctx.entry_index(ctx.pos // ratio, ratio), DROP)
        if ctx.cache["index_k_scale"]:  # fp8 cache: e5m2 codes + a power of two per key (exact)
            k, scale = quant.pack_index_keys(k)
            cache_s = ctx.cache["index_k_scale"][src]
            ctx.cache["index_k_scale"][src] = ctx.scatter(cache_s.reshape(-1), dst, scale).reshape(cache_s.shape)
        ctx.cache["index_k"][src] = ctx.scatter(flat, dst, k).reshape(cache.shape)

    def __call__(self, ctx: StepContext, x_TD, qr_TQ, src: int, ratio: int, freqs: np.ndarray,
                 tag: str = "") -> jax.Array:
        T = x_TD.shape[0]
        x_TD, qr_TQ = jax.lax.stop_gradient(x_TD), jax.lax.stop_gradient(qr_TQ)
        q = self.wq_b(qr_TQ).reshape(T, self.n_heads, self.head_dim)
        q = quant.act_quant_fp4(apply_rope(q, ctx.pos, freqs), 32, "ue8m0")
        scale = np.float32(self.head_dim ** -0.5 * self.n_heads ** -0.5)
        w = (self.weights_proj(x_TD).astype(jnp.float32) * scale).astype(jnp.bfloat16)
        cache = ctx.cache["index_k"][src]
        key_scale = ctx.cache["index_k_scale"][src].reshape(-1) if ctx.cache["index_k_scale"] else None
        n_vis = ctx.n_visible(ratio)
        # keys read in place from the paged cache (each row's entries), not gathered per token
        score = ops.indexer_scores_pool(q, cache.reshape(-1, cache.shape[-1]), ctx.row_entry_index(ratio),
                                        ctx.batch.token_row, w, n_vis, key_scale)
        ctx.tap(f"index{tag}_scores", score)
        if self.is_candidate_source:
            cand = ops.candidate_blocks(score, n_vis, self.cand_blocks, self.cand_block)
            ctx.candidates[src] = cand
            ctx.tap(f"cand{tag}_candidates", cand)
        elif self.uses_candidates:
            score = jnp.where(ctx.candidates[src], score, -jnp.inf)
        idx = ops.topk_positions(score, self.topk)
        ctx.tap(f"index{tag}_topk", idx)
        return idx
