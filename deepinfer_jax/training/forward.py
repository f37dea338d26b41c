"""The training forward: next-token logits at every position of full sequences ``[B, L]``, computed
by the model's own ragged prefill step (``DeepseekV41ForCausalLM.__call__``) on a freshly
allocated cache, so the math is the inference forward's.

Each sequence is one row of the ragged batch (slot ``b``, its own paged blocks), every token's
logits are requested (``logits_indices`` = all ``B * L`` tokens). The layout (positions, rows,
block tables) depends only on ``(B, L)``; the token ids are substituted inside the traced
function, so one compiled step serves every batch of that shape. The ops run their jnp
references on every platform (differentiable; the kernels compute the same numerics).

Engram layers: their hash ids come from the caller (``engram_ids_BLNC``, int ``[B, L,
n_engram_layers, n_hash_cols]``, row offsets included: what ``EngramHasher.hash_positions`` gives
for positions ``0..L-1`` of each row), since the host hasher lives in ``runner/``, which training
may not import. They fill the batch's ``engram_ids`` as the driver's ``RowSpec.engram_ids`` do.
"""

from __future__ import annotations

import contextlib
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
    """The training forward's limits today, named by field: none left (Engram layers take their
    hash ids from the caller, see ``check_engram_ids``); kept as the one place to add them."""


def engram_shape(cfg, batch: int, seq_len: int) -> tuple[int, int, int, int]:
    """``[B, L, n_engram_layers, n_hash_cols]`` of the Engram hash ids of a ``[B, L]`` batch."""
    return (batch, seq_len, len(cfg.engram_layer_ids), cfg.engram_n_hash_cols)


def check_engram_ids(cfg, tokens_shape, engram_ids_BLNC) -> None:
    """Required (of the right shape) when the config has Engram layers, refused otherwise."""
    B, L = tokens_shape
    if not cfg.engram_enabled:
        if engram_ids_BLNC is not None:
            raise ValueError(f"engram_ids_BLNC: given (shape {tuple(engram_ids_BLNC.shape)}) but the config has "
                             "no Engram layers (engram_layer_ids=())")
        return
    want = engram_shape(cfg, B, L)
    if engram_ids_BLNC is None:
        raise ValueError(f"engram_ids_BLNC: required, the config has Engram layers engram_layer_ids="
                         f"{tuple(cfg.engram_layer_ids)}; pass the host hasher's ids of shape {want} "
                         "(EngramHasher.hash_positions of positions 0..L-1 of each row)")
    if tuple(engram_ids_BLNC.shape) != want:
        raise ValueError(f"engram_ids_BLNC: shape {tuple(engram_ids_BLNC.shape)}, expected {want} "
                         "[batch, seq_len, n_engram_layers, n_hash_cols]")


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
                       n_engram_layers=len(cfg.engram_layer_ids),
                       n_hash_cols=cfg.engram_n_hash_cols if cfg.engram_enabled else 0, logits="all")


def train_batch(cfg, tokens_BL, engram_ids_BLNC=None) -> ForwardBatch:
    """The prefill batch of ``tokens_BL`` (numpy or jax int ``[B, L]``; may be traced): the layout
    of ``(B, L)`` with the token ids (and the Engram hash ids, token-major like the driver's rows)
    filled in."""
    check_engram_ids(cfg, tokens_BL.shape, engram_ids_BLNC)
    B, L = tokens_BL.shape
    lay = _layout(cfg, B, L)
    batch = jax.tree.map(jnp.asarray, lay)
    batch = dataclasses.replace(batch, token_ids=jnp.asarray(tokens_BL, jnp.int32).reshape(-1))
    if engram_ids_BLNC is not None:
        _, _, N, C = engram_ids_BLNC.shape
        batch = dataclasses.replace(batch, engram_ids=jnp.asarray(engram_ids_BLNC, jnp.int32).reshape(B * L, N, C))
    return batch


def train_forward(model, tokens_BL, engram_ids_BLNC=None, taps: dict | None = None, full_rows: bool = True):
    """``(logits [B, L, V] f32, the filled cache, main_hidden [B, L, n_targets*D] or None)``: the
    next-token logits of every position (position ``t`` of row ``b`` predicts token ``t + 1``), the
    cache the step wrote (the indexers' objective reads its compressed KV) and the DSpark context
    (the HC-mean of the stream entering each ``dspark_target_layer_ids`` layer; None without
    DSpark). ``engram_ids_BLNC``: the Engram hash ids (required when the config has Engram
    layers). ``taps``: a dict to fill with the forward's intermediate tensors (``ctx.tap``) for
    the auxiliary objectives (unused ones cost nothing under ``jit``). ``full_rows``: the sparse
    attention and the indexer scores take their dense per-row reference forms
    (``kernels_pallas/full_rows_ref.py``: much cheaper to differentiate; the indexer's arithmetic
    is the same, the attention's differs in summation order and in rounding the probabilities to
    bf16 against the final max, where the general reference does so per block of 64 entries);
    False runs the general references, bit for bit the inference prefill."""
    cfg = model.cfg
    check_trainable_config(cfg)
    check_engram_ids(cfg, tokens_BL.shape, engram_ids_BLNC)
    B, L = tokens_BL.shape
    cache = allocate_cache(cfg, train_cache_config(cfg, B, L))
    # the jnp references: they are the kernels' numerics, and differentiable (the Pallas kernels
    # define no VJP)
    rows = ops.full_rows(B, L) if full_rows else contextlib.nullcontext()
    with ops.use_backend("reference"), rows:
        cache, logits_TV, main_TX = model(cache, train_batch(cfg, tokens_BL, engram_ids_BLNC), taps)
    return logits_TV.reshape(B, L, -1), cache, (None if main_TX is None else main_TX.reshape(B, L, -1))


def train_logits(model, tokens_BL, engram_ids_BLNC=None, full_rows: bool = True) -> jax.Array:
    """f32 next-token logits ``[B, L, V]``: position ``t`` of row ``b`` predicts token ``t + 1``.
    ``engram_ids_BLNC``: the Engram hash ids (required when the config has Engram layers)."""
    return train_forward(model, tokens_BL, engram_ids_BLNC, full_rows=full_rows)[0]


def as_tokens(x) -> np.ndarray:
    """int32 ``[B, L]`` from anything array-like, with the shape checked."""
    a = np.asarray(x)
    if a.ndim != 2:
        raise ValueError(f"tokens: expected [batch, seq_len], got shape {a.shape}")
    return a.astype(np.int32)


def as_engram_ids(cfg, x, tokens_shape) -> np.ndarray | None:
    """int32 ``[B, L, n_engram_layers, n_hash_cols]`` (or None) with the shape checked."""
    if x is None:
        check_engram_ids(cfg, tokens_shape, None)
        return None
    a = np.asarray(x)
    check_engram_ids(cfg, tokens_shape, a)
    return a.astype(np.int32)
