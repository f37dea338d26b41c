"""Undo log of one forward step: exact rollback of rejected speculative tokens on device.

A verification row carries ``1 + l`` tokens (the known token and ``l <= spec_tokens`` drafts);
the forward writes all of them into the cache, verification then rejects a suffix of the row.
``record_undo`` (before the forward, from the batch alone) lists, for every token of the step,
the flat row of every cache array it writes (the arrays viewed as ``[shape[0] * shape[1], ...]``)
and gathers the values there; ``apply_undo`` (after verification, same jitted step) scatters the
old values back at the rejected tokens' rows. Cost: O(T * A) per array. Use in a step::

    log = record_undo(cache, batch, block_tokens, cfg)
    cache, log = fence(cache, log)          # the gathers before the forward's in-place writes
    cache, logits, _ = model(cache, batch)
    reject_T = ...                          # from the logits (verification)
    cache = apply_undo(cache, log, reject_T)

The fence and a ``reject_T`` computed from the logits give XLA an order between the log's reads,
the forward's writes and reads, and the restore; without them it copies the donated paged caches
(``comp_kv``, ``index_k_scale``) and the window rings to keep the unordered accesses apart
(``tests/test_cache_undo.py`` checks the step adds no cache-sized copy).

Recorded locations are the layers' own write masks:

* ``window[l]`` (and ``window_scale[l]`` when packed), ``dspark_window[k]``: ring slot ``slot * W + pos % W`` of each row's last W
  positions (``StepContext.ring_write``);
* ``comp_state_kv/score[i]`` (ratio r > 1): ``slot * M + pos % M`` of each row's last M
  positions; ratio-1 sources write no state (empty log);
* ``comp_kv[i]``, ``comp_kv_scale[i]``, ``index_k[i]``, ``index_k_scale[i]``: the paged entry ``pos // r`` of a token
  that completes its group at or above its row's ``cache_start`` (``StepContext.entry_index``).

The caller's contract: a row's rejected tokens are a suffix of it, and a row with rejections has
at most ``spec_tokens + 1`` tokens (``CacheConfig`` requires ``spec_tokens + 1 <= W`` and sizes
the state rings ``M >= spec_tokens + 1``). Then restoring the pre-step values at the rejected
tokens' locations gives the state of a step that never proposed them:

* no kept token writes a location a rejected token wrote: the row's positions are distinct and
  at most W (M) of them, so distinct mod W (M); a group completed by a kept token ends at or
  before it, so every group a rejected token completes is a later entry; other rows write other
  slots and other blocks;
* a kept token writes the same locations with or without the rejected suffix after it: a row of
  at most W (M) tokens writes every one of its positions either way, and a group's completion
  depends on the token's position alone;
* the rejected tokens' writes are the only other changes at their locations, so restoring the
  gathered values there undoes exactly them (duplicate locations would carry the same old value).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from deepinfer_jax.base.forward_batch import ForwardBatch
from deepinfer_jax.layers.attention.kv_index import DROP, StepContext
from deepinfer_jax.models.cache import ModelCache


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class CacheUndoLog:
    """Per ``ModelCache`` field (same names), one entry per array of that field."""

    index: dict  # field -> tuple of [T] int32 flat rows each token writes (DROP: none); [0] if never written
    old: dict    # field -> tuple of [T, ...] pre-step values at those rows


def _rows(a: jax.Array) -> jax.Array:
    """``[X, Y, ...]`` -> ``[X*Y, ...]``: the flat rows the log indexes."""
    return a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:])


def _ring_rows(ctx: StepContext, ring_SWA: jax.Array) -> jax.Array:
    """``[T]`` rows of ``ring_SWA`` (viewed ``[S*W, ...]``) each token writes: each row keeps its last W."""
    W = ring_SWA.shape[1]
    keep = ctx.valid & (ctx.pos >= ctx.end_T - W)
    return jnp.where(keep, ctx.slot_T * W + ctx.pos % W, DROP).astype(jnp.int32)


def _entry_rows(ctx: StepContext, ratio: int) -> jax.Array:
    """``[T]`` flat paged entries written: groups completed at or above the row's cache start."""
    done = ctx.valid & ((ctx.pos + 1) % ratio == 0) & (ctx.pos >= ctx.cache_start_T)
    return jnp.where(done, ctx.entry_index(ctx.pos // ratio, ratio), DROP).astype(jnp.int32)


def record_undo(cache: ModelCache, batch: ForwardBatch, block_tokens: int, cfg) -> CacheUndoLog:
    """Where each token of ``batch`` will write, and the values there now (call before the forward)."""
    ctx = StepContext(batch, {}, block_tokens, cache.window[0].shape[0])
    ratios = [cfg.compress_ratios[s] for s in cfg.kv_source_layer_ids]
    none = jnp.zeros((0,), jnp.int32)
    index = {
        "window": tuple(_ring_rows(ctx, a) for a in cache.window),
        "window_scale": tuple(_ring_rows(ctx, a) for a in cache.window_scale),
        "dspark_window": tuple(_ring_rows(ctx, a) for a in cache.dspark_window),
        "comp_kv": tuple(_entry_rows(ctx, r) for r in ratios),
        "comp_kv_scale": tuple(_entry_rows(ctx, r) for r in ratios[:len(cache.comp_kv_scale)]),
        "index_k": tuple(_entry_rows(ctx, r) for r in ratios),
        "index_k_scale": tuple(_entry_rows(ctx, r) for r in ratios[:len(cache.index_k_scale)]),
        "comp_state_kv": tuple(_ring_rows(ctx, a) if r > 1 else none for a, r in zip(cache.comp_state_kv, ratios)),
        "comp_state_score": tuple(_ring_rows(ctx, a) if r > 1 else none
                                  for a, r in zip(cache.comp_state_score, ratios)),
    }
    old = {f: tuple(jnp.take(_rows(a), i, axis=0, mode="clip") for a, i in zip(getattr(cache, f), index[f]))
           for f in index}
    return CacheUndoLog(index=index, old=old)


def fence(cache: ModelCache, log: CacheUndoLog) -> tuple[ModelCache, CacheUndoLog]:
    """Ties the log to the cache the forward then updates: its gathers come first, so the donated
    buffers are written in place instead of copied."""
    return jax.lax.optimization_barrier((cache, log))


def apply_undo(cache: ModelCache, log: CacheUndoLog, reject_T: jax.Array) -> ModelCache:
    """Restore the pre-step values at the locations of the tokens with ``reject_T`` (bool [T])."""
    out = {}
    for f in log.index:
        arrs = []
        for a, i, old in zip(getattr(cache, f), log.index[f], log.old[f]):
            if i.shape[0]:
                dst = jnp.where(reject_T, i, DROP)
                a = _rows(a).at[dst].set(old, mode="drop").reshape(a.shape)
            arrs.append(a)
        out[f] = tuple(arrs)
    return ModelCache(**out)
