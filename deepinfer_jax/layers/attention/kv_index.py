"""Where each token's KV lives: gather indices into the window rings and the paged caches, and
the per-step context the attention layers share.

Window entries of a token at position p: positions ``base + i`` for ``i < W`` with
``base = max(p - W + 1, 0)`` (ascending; entries past p, or below the row's window floor, are
unused) — the reference's entry order.
A position computed in this step is read from this step's fresh KV (the ring may already have
been overwritten by a later position of a long chunk); older ones from the request's ring.

Balanced context parallelism (``batch.cp``, ``sharding/context_parallel.py``): ``localized()``
is the context of this cp device's tokens. Its per-token views are the local tokens'; the fresh
KV they index is every token's (``fresh``), in flat order; ``all`` is the whole step's context
(the window rings and compressor state are written through it) and ``scatter`` applies every
device's cache writes on every device.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from deepinfer_jax.base.forward_batch import ForwardBatch
from deepinfer_jax.sharding import context_parallel

DROP = jnp.iinfo(jnp.int32).max  # scatter index that `mode="drop"` discards


@dataclasses.dataclass
class StepContext:
    """Trace-time state of one forward step: the batch, per-token views of its row data, the
    cache arrays being updated functionally, and what index/candidate layers hand down."""

    batch: ForwardBatch
    cache: dict            # field name -> list of arrays (ModelCache fields, made mutable)
    block_tokens: int
    num_slots: int
    taps: dict | None = None
    topk_idx: dict = dataclasses.field(default_factory=dict)   # kv source layer -> [T, K] positions
    candidates: dict = dataclasses.field(default_factory=dict)  # kv source layer -> [T, N] bool

    def __post_init__(self):
        b = self.batch
        self.all = self                         # the whole step's context (itself without CP)
        self.flat_T = jnp.arange(b.num_tokens)  # each token's index among the step's flat tokens
        self.home_T = None                      # CP: where the all-gather holds each flat token
        row = b.token_row
        self.pos = b.positions
        self.valid = b.token_valid
        self.slot_T = b.row_slot[row]
        self.start_T = b.row_start[row]
        self.end_T = b.row_start[row] + b.row_len[row]
        self.offset_T = b.row_token_offset[row]
        self.floor_T = b.row_floor[row]
        self.dec_floor_T = b.row_dec_floor[row]
        self.cache_start_T = b.row_cache_start[row]

    def compacted(self) -> "StepContext":
        """The context of the decoder layers' sub-batch (``batch.decoder``), sharing this one's
        cache; index/candidate results of earlier layers are gathered to its tokens. Under CP
        this is a local context's, and the result is the whole step's sub-batch (every cp
        device runs the decoder layers)."""
        if self.home_T is not None:
            ctx = self.all.compacted()   # the layers' results so far are this context's
            i = self.all.batch.decoder.token_index
            ctx.topk_idx = {k: self.rows(v, i) for k, v in self.topk_idx.items()}
            ctx.candidates = {k: self.rows(v, i) for k, v in self.candidates.items()}
            return ctx
        b, d = self.batch, self.batch.decoder
        i = d.token_index
        sub = dataclasses.replace(
            b, token_ids=b.token_ids[i], positions=b.positions[i], token_row=b.token_row[i],
            token_valid=d.token_valid, engram_ids=b.engram_ids[i], row_start=d.row_start,
            row_len=d.row_len, row_token_offset=d.row_token_offset,
            logits_indices=d.logits_indices, decoder=None)
        ctx = StepContext(sub, self.cache, self.block_tokens, self.num_slots, self.taps)
        ctx.topk_idx = {k: v[i] for k, v in self.topk_idx.items()}
        ctx.candidates = {k: v[i] for k, v in self.candidates.items()}
        return ctx

    # ---------------------------------------------------------------- context parallel
    @property
    def cp_split(self) -> bool:
        return self.home_T is not None

    def localized(self) -> "StepContext":
        """The context of this cp device's tokens of a CP step (``batch.cp``), sharing this
        one's cache; ``all`` of the result is this context."""
        b, lay = self.batch, self.batch.cp
        me = context_parallel.my_index()
        i, ok = lay.index_PN[me], lay.valid_PN[me]
        sub = dataclasses.replace(b, token_ids=b.token_ids[i], positions=b.positions[i], token_row=b.token_row[i],
                                  token_valid=b.token_valid[i] & ok, engram_ids=b.engram_ids[i])
        ctx = StepContext(sub, self.cache, self.block_tokens, self.num_slots, self.taps)
        ctx.all, ctx.flat_T, ctx.home_T = self, i, lay.home_T
        return ctx

    def fresh(self, x_TX: jax.Array) -> jax.Array:
        """This step's rows of every token in flat order (this context's own rows without CP)."""
        return x_TX if self.home_T is None else context_parallel.fresh(x_TX, self.home_T)

    def rows(self, x_TX: jax.Array, flat_K: jax.Array) -> jax.Array:
        """Rows of flat tokens ``flat_K`` of this step (``x_TX[flat_K]`` of the whole step; CP:
        from their owners)."""
        return x_TX[flat_K] if self.home_T is None else context_parallel.rows(x_TX, self.home_T, flat_K)

    def scatter(self, array, index, value):
        """``array.at[index].set(value, mode="drop")`` with every cp device's writes (CP)."""
        if self.home_T is not None:
            index = jax.tree.map(context_parallel.gather, index)
            value = context_parallel.gather(value)
        return array.at[index].set(value, mode="drop")

    # ---------------------------------------------------------------- sliding window
    def window_index(self, W: int, ring_rows: int, decoder: bool = False) -> jax.Array:
        """``[T, W]`` indices into ``concat(ring.reshape(S*W, A), fresh_kv_T)`` (-1 unused);
        ``decoder`` applies the decoder layers' floor instead of the all-layer one."""
        p = self.pos[:, None]
        q = jnp.maximum(self.pos - W + 1, 0)[:, None] + jnp.arange(W)[None, :]
        floor = self.dec_floor_T if decoder else self.floor_T
        ok = (q <= p) & (q >= floor[:, None]) & self.valid[:, None]
        fresh = q >= self.start_T[:, None]
        ring_i = self.slot_T[:, None] * W + q % W
        fresh_i = ring_rows + self.offset_T[:, None] + (q - self.start_T[:, None])
        return jnp.where(ok, jnp.where(fresh, fresh_i, ring_i), -1).astype(jnp.int32)

    def ring_write(self, ring_SWA: jax.Array, kv_TA: jax.Array) -> jax.Array:
        """Write each row's last W positions of this step into its ring (``kv_TA``: every token's
        KV of the step, ``fresh``; under CP the whole step's context writes it)."""
        if self.home_T is not None:
            return self.all.ring_write(ring_SWA, kv_TA)
        W = ring_SWA.shape[1]
        keep = self.valid & (self.pos >= self.end_T - W)
        s = jnp.where(keep, self.slot_T, DROP)
        return ring_SWA.at[s, self.pos % W].set(kv_TA.astype(ring_SWA.dtype), mode="drop")

    # ---------------------------------------------------------------- paged compressed caches
    def entry_index(self, entries: jax.Array, ratio: int) -> jax.Array:
        """Flat index into a ``[B*P]`` paged cache of compressed entries ``j`` of each token's row
        (``entries`` is ``[T]`` or ``[T, n]``)."""
        P = self.block_tokens // ratio
        bt = self.batch.block_table[self.batch.token_row]  # [T, max_blocks]
        e = entries if entries.ndim == 2 else entries[:, None]
        blk = jnp.take_along_axis(bt, jnp.clip(e // P, 0, bt.shape[1] - 1), axis=1)
        flat = blk * P + e % P
        return flat if entries.ndim == 2 else flat[:, 0]

    def row_entry_index(self, ratio: int) -> jax.Array:
        """``[R, N]`` flat indices of every compressed entry each row can address."""
        P = self.block_tokens // ratio
        bt = self.batch.block_table
        n = bt.shape[1] * P
        j = jnp.arange(n)
        return bt[:, j // P] * P + (j % P)[None, :]

    def n_visible(self, ratio: int) -> jax.Array:
        """Compressed entries visible to each token: ``(p + 1) // ratio`` (0 for padding)."""
        return jnp.where(self.valid, (self.pos + 1) // ratio, 0)

    def tap(self, name: str, value: jax.Array) -> None:
        if self.taps is not None:
            self.taps[name] = value
