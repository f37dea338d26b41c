"""The training forward: next-token logits at every position of full sequences ``[B, L]``, computed
by the model's own ragged prefill step (``DeepseekV41ForCausalLM.__call__``) on a freshly
allocated cache, so the math is the inference forward's.

Each sequence is one row of the ragged batch (slot ``b``, its own paged blocks), every token's
logits are requested (``logits_indices`` = all ``B * L`` tokens). The layout (positions, rows,
block tables) depends only on ``(B, L)``; the token ids are substituted inside the traced
function, so one compiled step serves every batch of that shape. The ops run their jnp
references on every platform (differentiable; the kernels compute the same numerics).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.base.block_size import default_block_tokens
from deepinfer_jax.base.forward_batch import ForwardBatch, RowSpec, build_batch
from deepinfer_jax.kernels_pallas import ops
from deepinfer_jax.models.cache import CacheConfig, allocate_cache


def check_trainable_config(cfg) -> None:
    """The training forward's limits today, named by field."""
    if cfg.engram_enabled:
        # the hash ids come from the runner's host hasher, which training may not import
        raise ValueError(f"engram_layer_ids={tuple(cfg.engram_layer_ids)}: the training forward does not "
                         "support Engram layers yet (set engram_layer_ids=())")


def train_cache_config(cfg, batch: int, seq_len: int) -> CacheConfig:
    """A cache with one slot and ``ceil(L / block_tokens)`` blocks per sequence."""
    bt = default_block_tokens(cfg)
    per_seq = -(-seq_len // bt)
    return CacheConfig(num_slots=batch, num_blocks=batch * per_seq, block_tokens=bt,
                       max_blocks_per_seq=per_seq).validate(cfg)


@functools.lru_cache(maxsize=16)
def _layout(cfg, batch: int, seq_len: int) -> ForwardBatch:
    cc = train_cache_config(cfg, batch, seq_len)
    per = cc.max_blocks_per_seq
    rows = [RowSpec([0] * seq_len, 0, b, list(range(b * per, (b + 1) * per))) for b in range(batch)]
    return build_batch(rows, num_tokens=batch * seq_len, num_rows=batch, max_blocks=per, num_slots=batch,
                       n_engram_layers=0, n_hash_cols=0, logits="all")


def train_batch(cfg, tokens_BL) -> ForwardBatch:
    """The prefill batch of ``tokens_BL`` (numpy or jax int ``[B, L]``; may be traced): the layout
    of ``(B, L)`` with the token ids filled in."""
    B, L = tokens_BL.shape
    lay = _layout(cfg, B, L)
    batch = jax.tree.map(jnp.asarray, lay)
    return dataclasses.replace(batch, token_ids=jnp.asarray(tokens_BL, jnp.int32).reshape(-1))


def train_logits(model, tokens_BL) -> jax.Array:
    """f32 next-token logits ``[B, L, V]``: position ``t`` of row ``b`` predicts token ``t + 1``."""
    cfg = model.cfg
    check_trainable_config(cfg)
    B, L = tokens_BL.shape
    cache = allocate_cache(cfg, train_cache_config(cfg, B, L))
    # the jnp references: they are the kernels' numerics, and differentiable (the Pallas kernels
    # define no VJP)
    with ops.use_backend("reference"):
        _, logits_TV, _ = model(cache, train_batch(cfg, tokens_BL))
    return logits_TV.reshape(B, L, -1)


def as_tokens(x) -> np.ndarray:
    """int32 ``[B, L]`` from anything array-like, with the shape checked."""
    a = np.asarray(x)
    if a.ndim != 2:
        raise ValueError(f"tokens: expected [batch, seq_len], got shape {a.shape}")
    return a.astype(np.int32)
