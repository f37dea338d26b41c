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

``cp`` (optional, balanced context parallelism): which of a dp rank's cp devices computes which
token (``base/cp_layout.py``); ``None`` computes every token on every device.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
from typing import Sequence

import jax
import numpy as np

from deepinfer_jax.base.cp_layout import CPLayout, mirror_layout


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
    cp: CPLayout | None = None

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
                num_decoder_tokens: int | None = None, cp_devices: int | None = None) -> ForwardBatch:
    """Pack rows into a padded ``ForwardBatch``. ``logits``: ``"last"`` (each row's last token),
    ``"all"`` (every token) or explicit flat indices; padded to ``num_logits`` with index 0.
    ``num_decoder_tokens`` (compact truncation) adds the ``DecoderView`` of the tokens at or above
    each row's decoder floor, padded to that size; logits indices must all be such tokens.
    ``cp_devices`` (> 1) adds the balanced context-parallel layout over that many devices."""
    lengths = np.fromiter((len(r.token_ids) for r in rows), np.int64, len(rows))
    engram = None
    if n_engram_layers and any(r.engram_ids is not None for r in rows):
        engram = np.zeros((int(lengths.sum()), n_engram_layers, max(n_hash_cols, 1)), np.int64)
        o = 0
        for r, n in zip(rows, lengths):
            if r.engram_ids is not None:
                engram[o:o + n] = r.engram_ids
            o += n
    return pack_batch(
        np.fromiter(itertools.chain.from_iterable(r.token_ids for r in rows), np.int64), lengths,
        np.fromiter((r.start for r in rows), np.int64, len(rows)),
        np.fromiter((r.slot for r in rows), np.int64, len(rows)), [r.blocks for r in rows],
        np.fromiter((r.floor for r in rows), np.int64, len(rows)),
        np.fromiter((r.decoder_floor() for r in rows), np.int64, len(rows)),
        np.fromiter((r.cache_start for r in rows), np.int64, len(rows)),
        engram_ids=engram, num_tokens=num_tokens, num_rows=num_rows, max_blocks=max_blocks,
        num_slots=num_slots, n_engram_layers=n_engram_layers, n_hash_cols=n_hash_cols, logits=logits,
        num_logits=num_logits, num_decoder_tokens=num_decoder_tokens, cp_devices=cp_devices)


def concat_ints(lists, total: int) -> np.ndarray:
    """Int sequences concatenated into an int64 array of ``total`` entries (``list.extend`` per
    sequence: faster than ``itertools.chain`` for many short ones)."""
    out: list = []
    collections.deque(map(out.extend, lists), maxlen=0)
    return np.fromiter(out, np.int64, total)


def padded(values_R, size: int, dtype=np.int32) -> np.ndarray:
    """A ``size`` array of ``dtype`` holding ``values_R`` first, zeros after (the per-row and
    per-token arrays of a bucket)."""
    out = np.zeros(size, dtype)
    out[:len(values_R)] = values_R
    return out


@functools.lru_cache(maxsize=64)
def arange_of(n: int) -> np.ndarray:
    """``np.arange(n)`` (int64), made once per length and read-only: a per-bucket constant of
    the step builders."""
    a = np.arange(n)
    a.flags.writeable = False
    return a


def pack_batch(token_ids, lengths, starts, slots, blocks: Sequence[Sequence[int]], floors, dec_floors,
               cache_starts, *, engram_ids=None, num_tokens: int, num_rows: int, max_blocks: int,
               num_slots: int, n_engram_layers: int, n_hash_cols: int,
               logits: str | Sequence[int] | np.ndarray = "last", num_logits: int | None = None,
               num_decoder_tokens: int | None = None, cp_devices: int | None = None,
               one_token_rows: bool | None = None) -> ForwardBatch:
    """``build_batch`` from per-row arrays, without a Python loop over rows (the engine's hot
    path): ``token_ids`` the rows' tokens concatenated, ``lengths`` / ``starts`` / ``slots`` /
    ``floors`` / ``dec_floors`` (already ``>= floors``) / ``cache_starts`` one entry per row,
    ``blocks`` each row's block ids, ``engram_ids`` ``[total, n_engram_layers, n_hash_cols]`` or
    None (zeros). ``one_token_rows``: whether every row has one token (decode steps; None:
    read from ``lengths``), which skips the token -> row maps."""
    n_R = np.asarray(lengths, np.int64)
    nr = n_R.shape[0]
    total = int(n_R.sum())
    if total > num_tokens:
        raise ValueError(f"num_tokens={num_tokens} < {total} tokens in the step")
    if nr > num_rows:
        raise ValueError(f"num_rows={num_rows} < {nr} rows in the step")
    if one_token_rows is None:
        one_token_rows = bool(nr) and total == nr and int(n_R.min()) == 1
    start_R = np.asarray(starts, np.int64)
    if one_token_rows:  # token t is row t's only token
        off_R = row_of_t = arange_of(nr)
        j_t = None
    else:
        off_R = np.zeros(nr, np.int64)
        np.cumsum(n_R[:-1], out=off_R[1:])
        row_of_t = np.repeat(arange_of(nr), n_R)                 # [total]
        j_t = arange_of(total) - off_R[row_of_t]                 # index of each token in its row
    tok = np.zeros(num_tokens, np.int32)
    tok[:total] = token_ids
    pos = np.zeros(num_tokens, np.int32)
    pos[:total] = start_R if j_t is None else start_R[row_of_t] + j_t
    trow = np.zeros(num_tokens, np.int32)
    trow[:total] = row_of_t
    valid = np.zeros(num_tokens, bool)
    valid[:total] = True
    eids = np.zeros((num_tokens, max(n_engram_layers, 1), max(n_hash_cols, 1)), np.int32)
    if engram_ids is not None and n_engram_layers:
        eids[:total] = engram_ids
    slot = np.full(num_rows, num_slots, np.int32)
    slot[:nr] = slots
    start = padded(start_R, num_rows)
    length = padded(n_R, num_rows)
    off = padded(off_R, num_rows)
    nb_R = np.fromiter(map(len, blocks), np.int64, nr)
    nb_max = int(nb_R.max()) if nr else 0
    if nb_max > max_blocks:
        i = int(np.argmax(nb_R > max_blocks))
        raise ValueError(f"row {i}: {int(nb_R[i])} blocks > max_blocks={max_blocks}")
    bt = np.zeros((num_rows, max_blocks), np.int32)
    flat_blocks = concat_ints(blocks, int(nb_R.sum()))
    if nr and int(nb_R.min()) == nb_max:  # every row as many blocks (usual in decode)
        bt[:nr, :nb_max] = flat_blocks.reshape(nr, nb_max)
    else:
        bt[:nr][arange_of(max_blocks)[None, :] < nb_R[:, None]] = flat_blocks
    floor = padded(floors, num_rows)
    dfloor = padded(dec_floors, num_rows)
    cstart = padded(cache_starts, num_rows)
    if isinstance(logits, str):
        if logits == "last":
            li = off_R + n_R - 1
        elif logits == "all":
            li = np.arange(total)
        else:
            raise ValueError(f"logits={logits!r}: expected 'last', 'all' or indices")
    else:
        li = np.asarray(logits, np.int64).reshape(-1)  # -1: a row whose logits nobody reads (computed at token 0)
    n_l = num_logits or max(len(li), 1)
    if len(li) > n_l:
        raise ValueError(f"num_logits={n_l} < {len(li)} requested logit rows")
    li_arr = np.zeros(n_l, np.int32)
    li_arr[: len(li)] = np.maximum(li, 0)
    dec = None
    if num_decoder_tokens is not None:
        dec = _decoder_view(n_R, off_R, start_R, dfloor[:nr].astype(np.int64), row_of_t, j_t, li,
                            num_decoder_tokens, num_rows, n_l, (valid, start, length, off, li_arr))
    cp = mirror_layout(n_R, num_tokens, cp_devices) if cp_devices and cp_devices > 1 else None
    return ForwardBatch(tok, pos, trow, valid, eids, slot, start, length, off, bt, li_arr,
                        floor, dfloor, cstart, dec, cp)


def _decoder_view(n_R, off_R, start_R, dfloor_R, row_of_t, j_t, logits_idx, num_dec: int, num_rows: int,
                  num_logits: int, own=None) -> DecoderView:
    """``own``: the batch's (token_valid, row_start, row_len, row_token_offset, logits_indices),
    which a view of every token shares."""
    nr = n_R.shape[0]
    first_R = np.minimum(np.maximum(dfloor_R - start_R, 0), n_R)  # first kept token of each row
    k_R = n_R - first_R
    n_dec = int(k_R.sum())
    if n_dec > num_dec:
        raise ValueError(f"num_decoder_tokens={num_dec} < decoder tokens in the step")
    if _no_skipped_tokens(first_R):  # every token is a decoder token (decode steps): the view is the batch's own
        return _full_decoder_view(n_R, off_R, start_R, n_dec, logits_idx, num_dec, num_rows, num_logits, own)
    odec_R = np.zeros(nr, np.int64)
    np.cumsum(k_R[:-1], out=odec_R[1:])
    row_of_d = np.repeat(np.arange(nr), k_R)
    jd = np.arange(n_dec) - odec_R[row_of_d]                      # index among the row's kept tokens
    index = np.zeros(num_dec, np.int32)
    index[:n_dec] = off_R[row_of_d] + first_R[row_of_d] + jd
    valid = np.zeros(num_dec, bool)
    valid[:n_dec] = True
    start = padded(start_R + first_R, num_rows)
    length = padded(k_R, num_rows)
    off = padded(odec_R, num_rows)
    n_full = row_of_t.shape[0]
    if j_t is None:  # (one token a row)
        j_t = np.zeros(n_full, np.int64)
    kept = j_t >= first_R[row_of_t]
    full_to_dec = np.full(n_full + 1, -1, np.int64)  # flat token -> decoder token (-1: not kept)
    full_to_dec[:n_full][kept] = odec_R[row_of_t[kept]] + j_t[kept] - first_R[row_of_t[kept]]
    li = np.zeros(num_logits, np.int32)
    want = np.asarray(logits_idx, np.int64)
    asked = want >= 0
    mapped = full_to_dec[np.where(asked, np.minimum(want, n_full), n_full)]
    if np.any(asked & (mapped < 0)):
        t = int(want[asked & (mapped < 0)][0])
        raise ValueError(f"logits index {t} is below its row's decoder floor (not computed)")
    li[: len(want)] = np.where(asked, mapped, 0)
    return DecoderView(index, valid, start, length, off, li)


def _no_skipped_tokens(first_R: np.ndarray) -> bool:
    """Whether every row's tokens are all decoder tokens: ``_full_decoder_view``'s condition (a
    test turns it off here to compare with the general path)."""
    return not first_R.any()


def _full_decoder_view(n_R, off_R, start_R, total: int, logits_idx, num_dec: int, num_rows: int,
                       num_logits: int, own=None) -> DecoderView:
    """``_decoder_view`` where no row skips a token: the same arrays from fewer operations
    (decoder token t is flat token t; the row arrays and logits indices are the batch's own,
    ``own``, shared where given)."""
    want = np.asarray(logits_idx, np.int64)
    asked = want >= 0
    if np.any(asked & (want >= total)):  # past the step's tokens: not a decoder token
        t = int(want[asked & (want >= total)][0])
        raise ValueError(f"logits index {t} is below its row's decoder floor (not computed)")
    index = np.zeros(num_dec, np.int32)
    index[:total] = arange_of(total)
    if own is not None:
        valid, start, length, off, li = own
        if valid.shape[0] == num_dec:
            return DecoderView(index, valid, start, length, off, li)
    nr = n_R.shape[0]
    valid = np.zeros(num_dec, bool)
    valid[:total] = True
    start = padded(start_R, num_rows)
    length = padded(n_R, num_rows)
    off = padded(off_R, num_rows)
    li = np.zeros(num_logits, np.int32)
    li[: len(want)] = np.where(asked, want, 0)
    return DecoderView(index, valid, start, length, off, li)
