"""The flat ragged batch one forward step consumes, and its host-side builder.

Tokens of all requests in the step are concatenated (T, padded to a bucket); each request has
one *row* (R, padded). A row computes the positions ``[row_start, row_start + row_len)`` of its
request; its tokens sit at ``[row_token_offset, row_token_offset + row_len)`` of the flat batch.
``row_slot`` names the request's sliding-window slot (window rings, compressor state, DSpark
rings); ``block_table`` names its paged blocks of the compressed-KV / index-key caches (block b
holds positions ``[b*block_tokens, (b+1)*block_tokens)``). Padding tokens have
``token_valid = False``; padding rows have ``row_len = 0`` and ``row_slot = num_slots`` (their
writes are dropped).

Bounded replay and YOCO truncation (FEATURES §5) use three per-row positions:

* ``row_floor``: window entries at positions below it are invisible in every layer (the slot
  holds no state for them: a replay after a prefix-cache hit starts there).
* ``row_dec_floor`` (>= ``row_floor``): the same for the *decoder* layers (``layer >=
  cfg.yoco_start_layer``, which keep only sliding-window state); YOCO truncation raises it to the
  request's last ``keep_tokens`` prompt positions.
* ``row_cache_start``: compressed-KV / index-key entries of positions below it are not written
  (they sit in prefix-cache blocks other requests may share).

``decoder`` (optional, the ``compact`` truncation mode): the tokens the decoder layers compute,
as a sub-batch; ``None`` runs the decoder layers on every token (``off`` and ``mask`` modes).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ForwardBatch:
    token_ids: jax.Array         # int32 [T]
    positions: jax.Array         # int32 [T]
    token_row: jax.Array         # int32 [T]
    token_valid: jax.Array       # bool  [T]
    engram_ids: jax.Array        # int32 [T, n_engram_layers, n_hash_cols] (table rows incl. offsets)
    row_slot: jax.Array          # int32 [R]
    row_start: jax.Array         # int32 [R]
    row_len: jax.Array           # int32 [R]
    row_token_offset: jax.Array  # int32 [R]
    block_table: jax.Array       # int32 [R, max_blocks]
    logits_indices: jax.Array    # int32 [L] flat token indices whose logits are returned
    row_floor: jax.Array         # int32 [R]
    row_dec_floor: jax.Array     # int32 [R]
    row_cache_start: jax.Array   # int32 [R]
    decoder: "DecoderView | None" = None

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecoderView:
    """The decoder layers' tokens (compact truncation): ``token_index[t']`` is a flat token of the
    full batch; rows keep their slots and block tables, with start/len/offset in the sub-batch;
    ``logits_indices`` index the sub-batch."""

    token_index: jax.Array       # int32 [T']
    token_valid: jax.Array       # bool  [T']
    row_start: jax.Array         # int32 [R]
    row_len: jax.Array           # int32 [R]
    row_token_offset: jax.Array  # int32 [R]
    logits_indices: jax.Array    # int32 [L]


@dataclasses.dataclass
class RowSpec:
    """One request's part of a step (host side)."""

    token_ids: Sequence[int]       # the tokens computed in this step
    start: int                     # position of token_ids[0]
    slot: int                      # sliding-window slot
    blocks: Sequence[int]          # paged block ids covering positions [0, start + len)
    engram_ids: np.ndarray | None = None  # [len, n_engram_layers, cols]
    floor: int = 0                 # first visible window position (all layers)
    dec_floor: int | None = None   # first visible window position of the decoder layers (>= floor)
    cache_start: int = 0           # first position whose compressed entries are written

    def decoder_floor(self) -> int:
        return max(self.floor, self.dec_floor if self.dec_floor is not None else self.floor)


def build_batch(rows: Sequence[RowSpec], *, num_tokens: int, num_rows: int, max_blocks: int,
                num_slots: int, n_engram_layers: int, n_hash_cols: int,
                logits: str | Sequence[int] = "last", num_logits: int | None = None,
                num_decoder_tokens: int | None = None) -> ForwardBatch:
    """Pack rows into a padded ``ForwardBatch``. ``logits``: ``"last"`` (each row's last token),
    ``"all"`` (every token) or explicit flat indices; padded to ``num_logits`` with index 0.
    ``num_decoder_tokens`` (compact truncation) adds the ``DecoderView`` of the tokens at or above
    each row's decoder floor, padded to that size; logits indices must all be such tokens."""
    total = sum(len(r.token_ids) for r in rows)
    if total > num_tokens:
        raise ValueError(f"num_tokens={num_tokens} < {total} tokens in the step")
    if len(rows) > num_rows:
        raise ValueError(f"num_rows={num_rows} < {len(rows)} rows in the step")
    tok = np.zeros(num_tokens, np.int32)
    pos = np.zeros(num_tokens, np.int32)
    trow = np.zeros(num_tokens, np.int32)
    valid = np.zeros(num_tokens, bool)
    eids = np.zeros((num_tokens, max(n_engram_layers, 1), max(n_hash_cols, 1)), np.int32)
    slot = np.full(num_rows, num_slots, np.int32)
    start = np.zeros(num_rows, np.int32)
    length = np.zeros(num_rows, np.int32)
    off = np.zeros(num_rows, np.int32)
    bt = np.zeros((num_rows, max_blocks), np.int32)
    floor = np.zeros(num_rows, np.int32)
    dfloor = np.zeros(num_rows, np.int32)
    cstart = np.zeros(num_rows, np.int32)
    last = []
    o = 0
    for i, r in enumerate(rows):
        n = len(r.token_ids)
        if len(r.blocks) > max_blocks:
            raise ValueError(f"row {i}: {len(r.blocks)} blocks > max_blocks={max_blocks}")
        tok[o:o + n] = r.token_ids
        pos[o:o + n] = np.arange(r.start, r.start + n)
        trow[o:o + n] = i
        valid[o:o + n] = True
        if r.engram_ids is not None and n_engram_layers:
            eids[o:o + n] = r.engram_ids
        slot[i], start[i], length[i], off[i] = r.slot, r.start, n, o
        bt[i, : len(r.blocks)] = r.blocks
        floor[i], dfloor[i], cstart[i] = r.floor, r.decoder_floor(), r.cache_start
        last.append(o + n - 1)
        o += n
    if isinstance(logits, str):
        if logits == "last":
            li = last
        elif logits == "all":
            li = list(range(total))
        else:
            raise ValueError(f"logits={logits!r}: expected 'last', 'all' or indices")
    else:
        li = list(logits)  # -1: a row whose logits nobody reads (computed at token 0)
    n_l = num_logits or max(len(li), 1)
    if len(li) > n_l:
        raise ValueError(f"num_logits={n_l} < {len(li)} requested logit rows")
    li_arr = np.zeros(n_l, np.int32)
    li_arr[: len(li)] = np.maximum(np.asarray(li, np.int64), 0)
    dec = None
    if num_decoder_tokens is not None:
        dec = _decoder_view(rows, li, num_decoder_tokens, num_rows, n_l)
    return ForwardBatch(tok, pos, trow, valid, eids, slot, start, length, off, bt, li_arr,
                        floor, dfloor, cstart, dec)


def _decoder_view(rows: Sequence[RowSpec], logits_idx: Sequence[int], num_dec: int, num_rows: int,
                  num_logits: int) -> DecoderView:
    index = np.zeros(num_dec, np.int32)
    valid = np.zeros(num_dec, bool)
    start = np.zeros(num_rows, np.int32)
    length = np.zeros(num_rows, np.int32)
    off = np.zeros(num_rows, np.int32)
    n_full = sum(len(r.token_ids) for r in rows)
    full_to_dec = np.full(n_full + 1, -1, np.int64)  # flat token -> decoder token (-1: not kept)
    o_full = o_dec = 0
    for i, r in enumerate(rows):
        n = len(r.token_ids)
        first = min(max(r.decoder_floor() - r.start, 0), n)  # first kept token of the row
        k = n - first
        if o_dec + k > num_dec:
            raise ValueError(f"num_decoder_tokens={num_dec} < decoder tokens in the step")
        index[o_dec:o_dec + k] = np.arange(o_full + first, o_full + n)
        valid[o_dec:o_dec + k] = True
        start[i], length[i], off[i] = r.start + first, k, o_dec
        full_to_dec[o_full + first:o_full + n] = np.arange(o_dec, o_dec + k)
        o_full += n
        o_dec += k
    li = np.zeros(num_logits, np.int32)
    want = np.asarray(list(logits_idx), np.int64)
    asked = want >= 0
    mapped = full_to_dec[np.where(asked, np.minimum(want, n_full), n_full)]
    if np.any(asked & (mapped < 0)):
        t = int(want[asked & (mapped < 0)][0])
        raise ValueError(f"logits index {t} is below its row's decoder floor (not computed)")
    li[: len(want)] = np.where(asked, mapped, 0)
    return DecoderView(index, valid, start, length, off, li)
