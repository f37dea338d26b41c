"""CSA2 attention sub-layer: sliding window + selected compressed KV, MQA with an attention sink,
grouped low-rank output.

q = wq_b(q_norm(wq_a x)) [H, A] with RoPE on the last rope dims; kv = kv_norm(wkv x) (one latent
per token, key and value), RoPE, fp8 QDQ. A compressed layer (ratio r > 0) also attends to
``index_topk`` entries of its KV source's compressed cache chosen by the most recent index layer.
The output gets the inverse RoPE at the query position, then ``wo_a`` (block-diagonal over
``o_groups``) and ``wo_b``.

With packed caches (``kv_cache_dtype="packed"``, ``base/kv_codes.py``) the window ring and the
compressed entries are written as codes + scales and handed to the attention as ``PackedPool`` s;
the values attended to are the same.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from deepinfer_jax.kernels_pallas import ops
from deepinfer_jax.base import batch_invariant as bi
from deepinfer_jax.base import kv_codes, quant
from deepinfer_jax.layers.attention.compressor import Compressor
from deepinfer_jax.layers.attention.indexer import Indexer
from deepinfer_jax.layers.attention.kv_index import DROP, StepContext
from deepinfer_jax.layers.linear import Linear
from deepinfer_jax.layers.norms import RMSNorm
from deepinfer_jax.layers.rope import apply_rope, layer_rope_freqs


class Attention(nnx.Module):
    def __init__(self, cfg, layer: int, dense_fmt: str):
        D, H, A = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        self.layer, self.n_heads, self.head_dim = layer, H, A
        self.window = cfg.sliding_window
        self.n_groups, self.o_rank = cfg.o_groups, cfg.o_lora_rank
        self.ratio = cfg.compress_ratios[layer]
        self.kv_src = cfg.kv_source_layer_ids.index(cfg.kv_source_of(layer)) if self.ratio else -1
        self.src_layer = cfg.kv_source_of(layer)
        self.is_decoder = cfg.is_backbone(layer) and layer >= cfg.yoco_start_layer
        self.freqs = tuple(float(f) for f in layer_rope_freqs(cfg, layer))
        self.attn_sink = nnx.Param(jnp.zeros((H,), jnp.float32), logical_axes=("heads",))
        self.wq_a = Linear(D, cfg.q_lora_rank, dense_fmt)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, H * A, dense_fmt)
        self.wkv = Linear(D, A, dense_fmt)
        self.kv_norm = RMSNorm(A, cfg.rms_norm_eps)
        # stored like the checkpoint, used dequantized (the reference holds it in bf16)
        self.wo_a = Linear(H * A // self.n_groups, self.n_groups * self.o_rank, dense_fmt)
        self.wo_b = Linear(self.n_groups * self.o_rank, D, dense_fmt)
        is_backbone = cfg.is_backbone(layer)
        if is_backbone and layer in cfg.kv_source_layer_ids:
            self.compressor = Compressor(cfg, layer)
        if is_backbone and layer in cfg.index_source_layer_ids:
            self.indexer = Indexer(cfg, layer, dense_fmt)

    # ------------------------------------------------------------------ pieces
    def project_q(self, x_TD, positions):
        qr = self.q_norm(self.wq_a(x_TD))
        q = self.wq_b(qr).reshape(x_TD.shape[0], self.n_heads, self.head_dim)
        return apply_rope(q, positions, self.freqs), qr

    def kv_latent(self, x_TD, positions):
        """The KV latent before its fp8 rounding."""
        return apply_rope(self.kv_norm(self.wkv(x_TD)), positions, self.freqs)

    def project_kv(self, x_TD, positions):
        return quant.act_quant_fp8(self.kv_latent(x_TD, positions))

    def output(self, o_THA, positions):
        o = apply_rope(o_THA, positions, self.freqs, inverse=True)
        T = o.shape[0]
        o = o.reshape(T, self.n_groups, -1)
        wo_a = self.wo_a.dequantized().reshape(self.n_groups, self.o_rank, -1)
        o = bi.rowwise(lambda o, w: jnp.einsum("tgd,grd->tgr", o, w, preferred_element_type=jnp.float32), o,
                       consts=(wo_a,))
        o = o.astype(jnp.bfloat16)
        return self.wo_b(o.reshape(T, -1))

    def _compressed(self, ctx: StepContext, x_TD, qr_TQ):
        """Update the source's compressed caches (source layers) and return the pool + indices."""
        r, src = self.ratio, self.kv_src
        if hasattr(self, "compressor"):
            latent, done = self.compressor(ctx, x_TD, src)
            ctx.tap(f"comp{self.layer}_latent", latent)
            ctx.tap(f"comp{self.layer}_done", done)
            if hasattr(self, "indexer"):
                self.indexer.write_keys(ctx, latent, done, src, r, self.freqs)
            ckv = apply_rope(latent, ctx.pos - (r - 1), self.freqs)
            dst = jnp.where(done & (ctx.pos >= ctx.cache_start_T), ctx.entry_index(ctx.pos // r, r), DROP)
            if ctx.cache["comp_kv_scale"]:  # packed: fp4 codes two a byte + e4m3 scales per 16
                codes, scales = kv_codes.pack_comp(ckv)
                for field, v in (("comp_kv", codes), ("comp_kv_scale", scales)):
                    cache = ctx.cache[field][src]
                    flat = cache.reshape(-1, cache.shape[-1])
                    ctx.cache[field][src] = ctx.scatter(flat, dst, v).reshape(cache.shape)
            else:
                ckv = quant.act_quant_fp4(ckv, 16, "e4m3")
                cache = ctx.cache["comp_kv"][src]
                flat = cache.reshape(-1, cache.shape[-1])
                ctx.cache["comp_kv"][src] = ctx.scatter(flat, dst, ckv).reshape(cache.shape)
        if hasattr(self, "indexer"):
            ctx.topk_idx[src] = self.indexer(ctx, x_TD, qr_TQ, src, r, self.freqs, tag=str(self.layer))
        pos_TK = ctx.topk_idx[src]
        flat_idx = jnp.where(pos_TK >= 0, ctx.entry_index(jnp.maximum(pos_TK, 0), r), -1)
        arrays = [ctx.cache["comp_kv"][src]]
        if ctx.cache["comp_kv_scale"]:
            arrays.append(ctx.cache["comp_kv_scale"][src])
        pool = [a.reshape(-1, a.shape[-1]) for a in arrays]
        return (kv_codes.PackedPool(*pool) if len(pool) == 2 else pool[0]), flat_idx

    # ------------------------------------------------------------------ forward
    def __call__(self, ctx: StepContext, x_TD: jax.Array) -> jax.Array:
        pos = ctx.pos
        q, qr = self.project_q(x_TD, pos)
        if hasattr(self, "indexer"):
            ctx.tap(f"attn{self.layer}_q", q)  # the indexer's training target (its attention)
        ring = ctx.cache["window"][self.layer]
        S, W = ring.shape[:2]
        idxs = [ctx.window_index(W, S * W, decoder=self.is_decoder)]
        if ctx.cache["window_scale"]:  # packed ring: fp8 codes + a scale byte per 32 channels
            # every token's KV of the step (CP: gathered), as the codes of act_quant_fp8
            fresh = kv_codes.PackedPool(*(ctx.fresh(a) for a in kv_codes.pack_window(self.kv_latent(x_TD, pos))))
            rings = (ring, ctx.cache["window_scale"][self.layer])
            pools = [kv_codes.PackedPool(*(jnp.concatenate([r.reshape(S * W, -1), f], axis=0)
                                           for r, f in zip(rings, fresh)))]
            ctx.cache["window"][self.layer] = ctx.ring_write(rings[0], fresh.codes)
            ctx.cache["window_scale"][self.layer] = ctx.ring_write(rings[1], fresh.scales)
        else:
            kv = ctx.fresh(self.project_kv(x_TD, pos))   # every token's KV of the step (CP: gathered)
            pools = [jnp.concatenate([ring.reshape(S * W, -1), kv], axis=0)]
            ctx.cache["window"][self.layer] = ctx.ring_write(ring, kv)
        if self.ratio:
            pool, idx = self._compressed(ctx, x_TD, qr)
            pools.append(pool)
            idxs.append(idx)
        o = ops.sparse_attention(q, tuple(pools), tuple(idxs), self.attn_sink[...], self.head_dim ** -0.5)
        return self.output(o, pos)
