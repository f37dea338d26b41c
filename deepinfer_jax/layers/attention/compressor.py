"""Compressor of a KV-source layer: one latent per group of ``ratio`` consecutive tokens.

ratio 1: ``latent = norm(wkv x)`` (bf16). ratio r > 1: per channel,
``latent = norm(sum_g softmax_g(wgate x_g) * (wkv x_g))`` over the group's tokens, in fp32.
Group j (positions ``j*r .. j*r+r-1``) completes at its last token; its members computed in an
earlier step come from the slot's pending state (``comp_state_kv/score``, ``[S, M, A]``), a
ring that keeps each row's last M >= r positions (position q at slot q % M; M > r when the cache
is sized for speculative rows, ``CacheConfig.spec_tokens``, so that a rejected draft's slot
never holds an accepted position; M comes from the array shape).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from deepinfer_jax.base import batch_invariant as bi
from deepinfer_jax.layers.attention.kv_index import DROP, StepContext
from deepinfer_jax.layers.linear import Linear
from deepinfer_jax.layers.norms import RMSNorm


class Compressor(nnx.Module):
    def __init__(self, cfg, layer: int):
        self.ratio = r = cfg.compress_ratios[layer]
        D, A = cfg.hidden_size, cfg.head_dim
        self.norm = RMSNorm(A, cfg.rms_norm_eps)
        # ratio 1 is a plain bf16 projection; softmax pooling (r > 1) runs in fp32
        self.wkv = Linear(D, A, "f32" if r > 1 else "bf16")
        if r > 1:
            self.wgate = Linear(D, A, "f32")

    def __call__(self, ctx: StepContext, x_TD: jax.Array, src: int):
        """Returns ``(latent_TA bf16 pre-RoPE, done_T)``: done where the token completes a group."""
        r = self.ratio
        done = ctx.valid & ((ctx.pos + 1) % r == 0)
        if r == 1:
            return self.norm(self.wkv(x_TD)), done
        # every token's projections of the step (CP: gathered; a group crosses chunk boundaries)
        kv = ctx.fresh(self.wkv(x_TD))      # fp32 [T, A]
        score = ctx.fresh(self.wgate(x_TD))  # fp32 [T, A]
        st_kv = ctx.cache["comp_state_kv"][src]
        st_sc = ctx.cache["comp_state_score"][src]
        T, M = kv.shape[0], st_kv.shape[1]
        mem_kv, mem_sc = [], []
        for m in range(r):
            q = ctx.pos - (r - 1) + m                         # member position
            t = jnp.clip(ctx.flat_T - (r - 1) + m, 0, T - 1)  # its flat token index if fresh
            fresh = q >= ctx.start_T
            slot = jnp.clip(ctx.slot_T, 0, st_kv.shape[0] - 1)
            mem_kv.append(jnp.where(fresh[:, None], kv[t], st_kv[slot, q % M]))
            mem_sc.append(jnp.where(fresh[:, None], score[t], st_sc[slot, q % M]))
        kv_g, sc_g = jnp.stack(mem_kv, 1), jnp.stack(mem_sc, 1)  # [T, r, A]
        latent = bi.row_sum(kv_g * bi.softmax(sc_g, axis=1), axis=1)
        # keep each row's last M positions as the pending group state (every token's: ctx.all)
        a = ctx.all
        keep = a.valid & (a.pos >= a.end_T - M)
        s = jnp.where(keep, a.slot_T, DROP)
        ctx.cache["comp_state_kv"][src] = st_kv.at[s, a.pos % M].set(kv, mode="drop")
        ctx.cache["comp_state_score"][src] = st_sc.at[s, a.pos % M].set(score, mode="drop")
        return self.norm(latent.astype(jnp.bfloat16)), done
