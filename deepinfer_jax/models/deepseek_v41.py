"""DeepSeek-V4.1 (Flax NNX): embed -> hc copies -> [Engram] -> blocks (CSA2 attention, MoE,
mHC residual) -> collapse -> norm -> head, plus the DSpark draft stages.

Module attribute names follow the official checkpoint names (``layers.N.attn.wq_a.weight``), so
a parameter's NNX path is its tensor name; routed experts are stacked (``ffn.experts.w1.weight``
holds ``ffn.experts.E.w1.weight`` for all E).

``__call__(cache, batch)`` runs one ragged step (any mix of prefill chunks and decode tokens) and
returns the updated cache and the logits at ``batch.logits_indices``; ``draft`` runs the DSpark
stages for one block per row. Neither stores per-call state on the modules.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from deepinfer_jax.base import batch_invariant as bi
from deepinfer_jax.layers import mhc
from deepinfer_jax.layers.attention.csa import Attention
from deepinfer_jax.layers.attention.kv_index import StepContext
from deepinfer_jax.layers.dspark import ConfidenceHead, Embed, MarkovHead, dspark_attention
from deepinfer_jax.layers.engram import Engram
from deepinfer_jax.layers.linear import Linear, dense_fmt, expert_fmt
from deepinfer_jax.layers.moe import MoE
from deepinfer_jax.layers.norms import RMSNorm
from deepinfer_jax.models.cache import ModelCache, cache_block_tokens
from deepinfer_jax.base.forward_batch import ForwardBatch
from deepinfer_jax.sharding import context_parallel


class Block(nnx.Module):
    """Attention + MoE sub-layers between mHC collapse/expand (delayed ``pre`` mixes)."""

    def __init__(self, cfg, layer: int, engram_rows: int | None = None):
        D, C = cfg.hidden_size, cfg.hc_mult
        fmt = dense_fmt(cfg.weight_dtype)
        self.layer = layer
        self.hc_mult, self.hc_iters, self.hc_eps, self.norm_eps = C, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps
        self.attn = Attention(cfg, layer, fmt)
        self.ffn = MoE(cfg, layer, fmt, expert_fmt(cfg.expert_dtype if cfg.weight_dtype == "fp8" else "bf16"))
        self.attn_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale = mhc.hc_params(D, C)
        self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale = mhc.hc_params(D, C)
        if engram_rows is not None:
            self.engram = Engram(cfg, engram_rows, fmt)

    def _hc_kw(self) -> dict:
        return dict(hc=self.hc_mult, iters=self.hc_iters, hc_eps=self.hc_eps, norm_eps=self.norm_eps)

    def __call__(self, x_TCD, pre_TC, attend, taps: dict | None = None):
        """``attend(x_TD) -> out_TD`` is the attention of this step's kind. Returns the new stream
        and the FFN ``pre`` mix that the next block's attention collapses with."""
        res = x_TCD
        attn_pre, attn_post, attn_comb = mhc.hc_mixes(
            x_TCD, self.hc_attn_fn[...], self.hc_attn_base[...], self.hc_attn_scale[...], **self._hc_kw())
        out = attend(self.attn_norm(mhc.collapse(x_TCD, pre_TC)))
        if taps is not None:
            taps[f"attn{self.layer}_out"] = out
        x_TCD = mhc.expand(out, res, attn_post, attn_comb)
        res = x_TCD
        ffn_pre, ffn_post, ffn_comb = mhc.hc_mixes(
            x_TCD, self.hc_ffn_fn[...], self.hc_ffn_base[...], self.hc_ffn_scale[...], **self._hc_kw())
        out = self.ffn(self.ffn_norm(mhc.collapse(x_TCD, attn_pre)), taps, str(self.layer))
        return mhc.expand(out, res, ffn_post, ffn_comb), ffn_pre


class DSparkStage(Block):
    """A DSpark stage (checkpoint ``mtp.K``); stage 0 owns the context projection, the last
    stage the output norm, Markov head and confidence head."""

    def __init__(self, cfg, stage: int):
        super().__init__(cfg, cfg.num_hidden_layers + stage)
        D = cfg.hidden_size
        if stage == 0:
            self.main_proj = Linear(D * len(cfg.dspark_target_layer_ids), D, dense_fmt(cfg.weight_dtype))
            self.main_norm = RMSNorm(D, cfg.rms_norm_eps)
        if stage == cfg.num_nextn_predict_layers - 1:
            self.norm = RMSNorm(D, cfg.rms_norm_eps)
            self.markov_head = MarkovHead(cfg.vocab_size, cfg.dspark_markov_rank)
            self.confidence_head = ConfidenceHead(D + cfg.dspark_markov_rank)


@dataclasses.dataclass
class DraftOutput:
    token_ids: jax.Array   # int32 [R, block+1]: the input token, then the greedy drafts
    logits: jax.Array      # f32 [R, block, V] (Markov bias included)
    confidence: jax.Array  # f32 [R, block] logits: sigmoid = P(accepted | earlier accepted)


class DeepseekV41ForCausalLM(nnx.Module):
    def __init__(self, cfg, engram_rows: tuple[int, ...] | None = None):
        cfg.validate()
        self.cfg = cfg
        D = cfg.hidden_size
        self.embed = Embed(cfg.vocab_size, D)
        rows = tuple(engram_rows if engram_rows is not None else cfg.engram_num_embeddings)
        self.layers = nnx.List([
            Block(cfg, i, rows[cfg.engram_layer_ids.index(i)] if i in cfg.engram_layer_ids else None)
            for i in range(cfg.num_hidden_layers)
        ])
        self.norm = RMSNorm(D, cfg.rms_norm_eps)
        self.head = Linear(D, cfg.vocab_size, "f32", axes=("vocab", None))
        n_stages = cfg.num_nextn_predict_layers if cfg.dspark_enabled else 0
        self.mtp = nnx.List([DSparkStage(cfg, k) for k in range(n_stages)])

    # ------------------------------------------------------------------ helpers
    def _context(self, cache: ModelCache, batch: ForwardBatch, taps) -> StepContext:
        cfg = self.cfg
        cdict = {f.name: list(getattr(cache, f.name)) for f in dataclasses.fields(cache)}
        return StepContext(batch, cdict, cache_block_tokens(cache, cfg), cache.window[0].shape[0], taps)

    @staticmethod
    def _pack(ctx: StepContext) -> ModelCache:
        return ModelCache(**{k: tuple(v) for k, v in ctx.cache.items()})

    def logits(self, h_TD: jax.Array) -> jax.Array:
        return self.head(h_TD)

    # ------------------------------------------------------------------ target forward
    def __call__(self, cache: ModelCache, batch: ForwardBatch, taps: dict | None = None):
        """One ragged step. Returns ``(cache', logits [L, V] f32 at batch.logits_indices,
        main_hidden [T, n_targets*D] or None)``. With ``batch.decoder`` (compact truncation) the
        decoder layers run on its tokens: logits are at its ``logits_indices`` and main_hidden
        has its ``T'`` rows. With ``batch.cp`` (balanced context parallelism, inside the DP
        step's ``shard_map``) each cp device computes its own tokens up to the head, or up to
        the decoder layers of a compact truncation (``sharding/context_parallel.py``)."""
        cfg = self.cfg
        ctx = self._context(cache, batch, taps)
        n = cfg.num_hidden_layers
        split = n if batch.decoder is None else min(cfg.yoco_start_layer, n)
        if batch.cp is not None:
            if taps is not None:
                raise ValueError("DeepseekV41ForCausalLM: taps are not recorded in a context-parallel step")
            ctx = ctx.localized()
        x = self.embed(ctx.batch.token_ids)
        x = jnp.repeat(x[:, None, :], cfg.hc_mult, axis=1)
        pre = jnp.zeros(x.shape[:2], jnp.float32).at[:, 0].set(1.0)
        main = []
        if ctx.cp_split:
            with context_parallel.use(ctx.flat_T, ctx.valid):
                x, pre = self._blocks(ctx, x, pre, main, 0, split, taps)
        else:
            x, pre = self._blocks(ctx, x, pre, main, 0, split, taps)
        if split < n:
            # compact YOCO truncation: the decoder layers run on the kept tokens only (under CP
            # on every cp device, their rows brought from the tokens' owners)
            keep = batch.decoder.token_index
            x, pre, main = ctx.rows(x, keep), ctx.rows(pre, keep), [ctx.rows(m, keep) for m in main]
            ctx = ctx.compacted()
            x, pre = self._blocks(ctx, x, pre, main, split, n, taps)
        elif ctx.cp_split:   # back to flat order on every cp device for the head
            x, pre, main = ctx.fresh(x), ctx.fresh(pre), [ctx.fresh(m) for m in main]
            ctx = ctx.all
        batch = ctx.batch
        h = self.norm(mhc.collapse(x, pre))
        ctx.tap("final_norm_out", h)
        logits = self.logits(h[batch.logits_indices])
        main_hidden = jnp.concatenate(main, axis=-1) if main and cfg.dspark_enabled else None
        if main_hidden is not None and len(self.mtp):
            ctx.tap("main_hidden", main_hidden)
            self._seed_dspark(ctx, main_hidden)
        return self._pack(ctx), logits, main_hidden

    def _blocks(self, ctx: StepContext, x, pre, main: list, first: int, last: int, taps):
        """Layers ``[first, last)`` on ``ctx``'s tokens; DSpark target layers' inputs -> ``main``."""
        cfg = self.cfg
        for i in range(first, last):
            block = self.layers[i]
            if hasattr(block, "engram"):
                e = cfg.engram_layer_ids.index(i)
                x = block.engram(x, ctx.batch.engram_ids[:, e, :])
                ctx.tap(f"engram{i}_out", x)
            if i in cfg.dspark_target_layer_ids:
                main.append(bi.row_mean(x.astype(jnp.float32), axis=1).astype(x.dtype))
            x, pre = block(x, pre, lambda h, b=block: b.attn(ctx, h), taps)
            ctx.tap(f"block{i}_h", x)
            ctx.tap(f"block{i}_pre_mix", pre)
        return x, pre

    def _seed_dspark(self, ctx: StepContext, main_hidden_TX: jax.Array) -> None:
        """Write every stage's ``kv(main_x)`` of this step's positions into its ring."""
        s0 = self.mtp[0]
        main_x = s0.main_norm(s0.main_proj(main_hidden_TX))
        for k, stage in enumerate(self.mtp):
            kv = stage.attn.project_kv(main_x, ctx.pos)
            ctx.cache["dspark_window"][k] = ctx.ring_write(ctx.cache["dspark_window"][k], kv)

    # ------------------------------------------------------------------ DSpark draft
    def draft_block(self, rings, ids_RB: jax.Array, last_pos_R: jax.Array, slot_R: jax.Array,
                    taps: dict | None = None) -> tuple[jax.Array, jax.Array]:
        """The stages' forward of one block per row: ``ids_RB`` at positions ``last_pos_R + 1 ..``,
        stage ``k`` attending to ``rings[k]`` (``[S, W, A]``, slot ``slot_R``, valid up to
        ``last_pos_R``) and the whole block. Returns the collapse hidden ``h_RBD`` (not normed) and
        the logits ``[R, B, V]`` without the Markov bias."""
        cfg = self.cfg
        R, blk = ids_RB.shape
        pos = (last_pos_R[:, None] + 1 + jnp.arange(blk)[None, :]).reshape(-1)
        x = self.embed(ids_RB.reshape(-1))
        x = jnp.repeat(x[:, None, :], cfg.hc_mult, axis=1)
        pre = jnp.zeros(x.shape[:2], jnp.float32).at[:, 0].set(1.0)
        for k, stage in enumerate(self.mtp):
            ring = rings[k]
            attend = lambda h, s=stage, r=ring: dspark_attention(s.attn, r, h, pos, slot_R, last_pos_R, blk)
            x, pre = stage(x, pre, attend)
            if taps is not None:
                taps[f"dspark_mtpblock{k}_h"] = x.reshape(R, blk, *x.shape[1:])
                taps[f"dspark_mtpblock{k}_pre_mix"] = pre.reshape(R, blk, -1)
        h = mhc.collapse(x, pre)
        logits = self.logits(self.mtp[-1].norm(h)).reshape(R, blk, -1)
        return h.reshape(R, blk, -1), logits

    def draft(self, cache: ModelCache, input_ids_R: jax.Array, last_pos_R: jax.Array, slot_R: jax.Array,
              taps: dict | None = None) -> DraftOutput:
        """Draft one block per row after the target sampled ``input_ids_R`` for position
        ``last_pos_R + 1``; the stage rings must hold the context up to ``last_pos_R``."""
        cfg = self.cfg
        blk = cfg.dspark_block_size
        R = input_ids_R.shape[0]
        ids = jnp.full((R, blk), cfg.dspark_noise_token_id, jnp.int32).at[:, 0].set(input_ids_R)
        h, logits = self.draft_block(cache.dspark_window, ids, last_pos_R, slot_R, taps)
        last = self.mtp[-1]
        out_ids = [input_ids_R.astype(jnp.int32)]
        embeds = []
        for i in range(blk):
            bias, emb = last.markov_head(out_ids[-1])
            row = logits[:, i] + bias
            logits = logits.at[:, i].set(row)
            embeds.append(emb)
            out_ids.append(jnp.argmax(row, axis=-1).astype(jnp.int32))
        conf = last.confidence_head(h, jnp.stack(embeds, axis=1))
        return DraftOutput(jnp.stack(out_ids, axis=1), logits, conf)
