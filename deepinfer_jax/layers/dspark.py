"""DSpark draft pieces: the stage attention over (window of target context ∪ draft block), the
Markov head (low-rank bigram logit bias) and the confidence head.

A stage keeps its own ring of ``kv(main_x)`` per slot, where ``main_x`` is the projected context
of the target layers at each target position. A draft block of ``dspark_block_size`` tokens at
positions ``p+1 .. p+block`` attends to the ring (slot order, as the reference lists it) and to
every block position (no causal mask inside the block). Draft KV is never cached.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from deepinfer_jax.kernels_pallas import ops
from deepinfer_jax.layers.attention.csa import Attention
from deepinfer_jax.layers.linear import Linear, matmul_f32


def dspark_attention(attn: Attention, ring_SWA: jax.Array, x_TD: jax.Array, pos_T: jax.Array,
                     slot_R: jax.Array, last_pos_R: jax.Array, block: int) -> jax.Array:
    """Attention of a draft block (``x_TD`` = R rows x ``block`` tokens, row-major)."""
    R = slot_R.shape[0]
    q, _ = attn.project_q(x_TD, pos_T)
    kv = attn.project_kv(x_TD, pos_T)
    S, W, A = ring_SWA.shape
    i = jnp.arange(W)[None, :]
    ring_idx = jnp.where(i <= last_pos_R[:, None], jnp.clip(slot_R, 0, S - 1)[:, None] * W + i, -1)
    blk_idx = S * W + jnp.arange(R)[:, None] * block + jnp.arange(block)[None, :]
    idx_RM = jnp.concatenate([ring_idx, blk_idx], axis=1).astype(jnp.int32)
    idx_TM = jnp.repeat(idx_RM, block, axis=0)
    pool = jnp.concatenate([ring_SWA.reshape(S * W, A), kv], axis=0)
    o = ops.sparse_attention(q, (pool,), (idx_TM,), attn.attn_sink[...], attn.head_dim ** -0.5)
    return attn.output(o, pos_T)


class Embed(nnx.Module):
    def __init__(self, vocab: int, dim: int):
        self.weight = nnx.Param(jnp.zeros((vocab, dim), jnp.bfloat16), logical_axes=("vocab", None))

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], ids, axis=0)


class MarkovHead(nnx.Module):
    def __init__(self, vocab: int, rank: int):
        self.embed = Embed(vocab, rank)
        self.head = Linear(rank, vocab, "f32", axes=("vocab", None))

    def __call__(self, ids_R: jax.Array):
        emb = self.embed(ids_R)
        return self.head(emb), emb


class ConfidenceHead(nnx.Module):
    def __init__(self, dim: int):
        self.proj = Linear(dim, 1, "f32")

    def __call__(self, hidden: jax.Array, markov_embed: jax.Array) -> jax.Array:
        h = jnp.concatenate([hidden, markov_embed], axis=-1)
        return matmul_f32(h, self.proj.weight[...].T)[..., 0]
