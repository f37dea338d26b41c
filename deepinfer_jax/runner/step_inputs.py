"""Host side of one jitted step: a ``SchedulerOutput`` -> padded numpy arrays (``StepInput``).

Shapes are fixed by the bucket: T tokens (a ``token_buckets`` size), R = ``max_num_seqs`` rows,
optionally T' decoder tokens (compact YOCO truncation). Every row gets one logits row (row r of
the sampler); rows that do not sample are padding for the sampler. With prompt logprobs the
logits rows continue with one row per flat token (``R + T`` in all).

Verification rows (speculative decoding, ``spec_slots = K > 0``): every row gets Kv+1 logits rows
(``R*(Kv+1)`` sampler slots in all, row r's slot i at the token of its i-th verification position,
slots past the row's drafts repeat its last token) and ``draft_RK`` / ``num_drafts_R`` carry the
drafts being judged. Kv (``verify_slots``) is K in a verification step and 0 in a plain step
(``SchedulerOutput.spec_plain``): the jitted step reads which from ``draft_RK``'s width.

Placeholders: a decode token sampled by the previous step is not known here; its entry in
``prev_row`` names the previous step's logits row and the device substitutes the id (and, with
Engram, finishes its hash from ``engram_partials``).
"""

from __future__ import annotations

import dataclasses
import operator

import jax
import numpy as np

from deepinfer_jax.runner.engram_hash_device import window_partials
from deepinfer_jax.base.forward_batch import ForwardBatch, arange_of, concat_ints, pack_batch
from deepinfer_jax.sampling.sampler import SamplingBatch, SamplingReuse, sampling_batch_of


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepInput:
    batch: ForwardBatch
    sampling: SamplingBatch
    prev_row: jax.Array                     # int32 [T]: previous step's logits row, -1 = known id
    engram_partials: jax.Array | None       # uint32 [T, n_engram_layers, K-1, 2] (placeholders only)
    prompt_targets: jax.Array | None        # int32 [T]: next prompt token of each flat token
    draft_RK: jax.Array | None = None       # int32 [R, K]: verification rows' drafts (spec steps)
    num_drafts_R: jax.Array | None = None   # int32 [R]: drafts of each row, 0..K
    # the leading verification slots each row's banned ids apply to (min_tokens; spec steps)
    ban_slots_R: jax.Array | None = None    # int32 [R], 0..K+1
    # async speculation: the previous step's row whose outputs give this row's tokens (-1: the
    # host knows them), and the n-gram context: H known tokens + that row's drafts (-1 padded)
    spec_prev_row_R: jax.Array | None = None   # int32 [R]
    spec_ctx_RC: jax.Array | None = None       # int32 [R, H + K]
    # structured output: int32 bitmask per sampler row, [R, W] (plain) or [R, K+1, W] (spec);
    # -1 words (all allowed) for rows without a grammar; None when no row of the step has one
    allowed_RW: jax.Array | None = None


NUM_BANNED = 8  # banned ids per sampler row (EOS + stop ids under min_tokens); more recompiles


def pick_bucket(n: int, buckets) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} tokens exceed the largest bucket {buckets[-1]}")


def banned_width(sched) -> int:
    """Banned ids per sampler row of a step: ``NUM_BANNED``, or more when a row bans more (the
    decode columns' rows ban nothing)."""
    return _banned_width(list(map(_banned, sched.tail_rows)))


def _banned_width(banned: list) -> int:
    # (ScheduledRow.banned are lists: any() is their truth, and usually none bans anything)
    return max(NUM_BANNED, max(map(len, banned), default=0)) if any(banned) else NUM_BANNED


# the rows' fields, read a column at a time (attrgetter + fromiter: no Python frame per row)
_tokens = operator.attrgetter("token_ids")
_start = operator.attrgetter("start")
_prev_row = operator.attrgetter("prev_row")
_sample = operator.attrgetter("sample")
_slot = operator.attrgetter("slot")
_blocks = operator.attrgetter("blocks")
_floor = operator.attrgetter("floor")
_dec_floor = operator.attrgetter("dec_floor")
_cache_start = operator.attrgetter("cache_start")
_params = operator.attrgetter("params")
_seed = operator.attrgetter("seed")
_banned = operator.attrgetter("banned")
_history = operator.attrgetter("history")
_num_drafts = operator.attrgetter("num_drafts")
_first = operator.itemgetter(0)


def _one_token_rows(n_R: np.ndarray, total: int) -> bool:
    """Whether every row has one token (decode steps): the fast paths' condition (a test turns
    them off here to compare with the general path)."""
    return total == n_R.shape[0] > 0 and int(n_R.min()) == 1


def build_step_input(sched, *, num_tokens: int, num_rows: int, num_decoder_tokens: int | None,
                     cache_config, hasher, vocab: int, prompt_lp: bool, spec_slots: int = 0,
                     num_banned: int | None = None, with_masks: bool | None = None,
                     cp_devices: int | None = None, verify_slots: int | None = None,
                     reuse: SamplingReuse | None = None) -> StepInput:
    """Pad ``sched.rows`` (plain ``ScheduledRow`` data) into a ``StepInput`` of the given bucket sizes.
    ``num_banned`` (default ``banned_width(sched)``) and ``with_masks`` (default: whether a row
    has a grammar mask) fix those parts of the layout, so that the DP ranks' inputs of one step
    share it. ``cp_devices`` (> 1): the tokens' balanced context-parallel layout over that many
    devices (``base/cp_layout.py``). ``verify_slots``: the drafts a row may carry in this step
    (default ``spec_slots``; 0 for a plain step of a speculative engine). ``reuse``: the
    caller's ``SamplingReuse`` (sampling arrays of its previous step that stay the same).

    Vectorised over rows and tokens (the engine's per-step host path): the rows' fields are read
    once into arrays, the Engram hashes of every known token and the partial hashes of every
    placeholder come from one call each over all rows' look-back windows."""
    K = spec_slots
    Kv = K if verify_slots is None else verify_slots
    if not 0 <= Kv <= K:
        raise ValueError(f"verify_slots={verify_slots}: must be in [0, spec_slots={K}]")
    d = sched.decode
    if (d is not None and not sched.tail_rows and not prompt_lp and not sched.grammar_masks and d.spec == bool(K)
            and (not K or Kv == 0)
            and (hasher is None or d.history_RH is not None and d.history_RH.shape[1] == hasher.max_ngram_size - 1)):
        kw = dict(num_tokens=num_tokens, num_rows=num_rows, num_decoder_tokens=num_decoder_tokens,
                  cache_config=cache_config, hasher=hasher, vocab=vocab, num_banned=num_banned,
                  with_masks=bool(with_masks), cp_devices=cp_devices, reuse=reuse)
        return _decode_step_input(d, spec_slots=K, **kw)
    rows = sched.rows
    nr = len(rows)
    toks_R = list(map(_tokens, rows))
    n_R = np.fromiter(map(len, toks_R), np.int64, nr)
    total = int(n_R.sum())
    one = _one_token_rows(n_R, total)
    if one:  # the flat token of row r is token r
        off_R = row_of_t = last_t = arange_of(nr)
    else:
        off_R = np.zeros(nr, np.int64)
        np.cumsum(n_R[:-1], out=off_R[1:])
        row_of_t = np.repeat(arange_of(nr), n_R)
        last_t = off_R + n_R - 1  # each row's last flat token
    start_R = np.fromiter(map(_start, rows), np.int64, nr)
    prev_R = np.fromiter(map(_prev_row, rows), np.int64, nr)
    sample_R = np.fromiter(map(_sample, rows), bool, nr)
    device_R = (np.fromiter((r.spec_ctx is not None for r in rows), bool, nr) if K else None)
    tok_t = np.fromiter(map(_first, toks_R), np.int64, nr) if one else concat_ints(toks_R, total)

    # placeholders: a row's last token was sampled by the previous step (device rows: all tokens)
    ph_R = prev_R >= 0
    if device_R is not None and device_R.any():
        ph_R &= ~device_R
        tok_t[device_R[row_of_t]] = 0
    else:
        device_R = None  # no device rows (every row's tokens are on the host)
    ph_last_t = last_t[ph_R]
    prev = np.full(num_tokens, -1, np.int32)
    prev[ph_last_t] = prev_R[ph_R]
    tok_t[ph_last_t] = 0

    n_layers = hasher.n_layers if hasher is not None else 0
    partials = eids = None
    if hasher is not None:
        partials = np.zeros((num_tokens, n_layers, hasher.max_ngram_size - 1, 2), np.uint32)
        eids = _engram_ids(rows, hasher, n_R, off_R, start_R, ph_R, device_R, row_of_t, last_t, partials, one)

    drafts = n_drafts = ban_slots = spec_prev = spec_ctx = None
    nd_R = np.fromiter(map(_num_drafts, rows), np.int64, nr) if K else None
    banned = list(map(_banned, rows))
    if K:
        if device_R is None:
            device_R = np.zeros(nr, bool)
        if nr and nd_R.max() > Kv:
            i = int(np.argmax(nd_R > Kv))
            raise ValueError(f"row of request {rows[i].request_id!r}: {int(nd_R[i])} drafts > {Kv} verification slots")
        first_R = last_t - nd_R
        j = np.arange(Kv + 1)
        lr = np.where(sample_R[:, None], first_R[:, None] + np.minimum(j[None, :], nd_R[:, None]), -1)
        logit_rows = np.full(num_rows * (Kv + 1), -1, np.int64)
        logit_rows[:nr * (Kv + 1)] = lr.reshape(-1)
        drafts = np.zeros((num_rows, Kv), np.int32)
        has = (np.arange(Kv)[None, :] < nd_R[:, None]) & ~device_R[:, None]
        src = np.minimum(first_R[:, None] + 1 + np.arange(Kv)[None, :], max(total - 1, 0))
        drafts[:nr][has] = tok_t[src[has]]
        n_drafts = np.zeros(num_rows, np.int32)
        n_drafts[:nr] = nd_R
        ban_slots = np.zeros(num_rows, np.int32)
        ban_slots[:nr] = np.fromiter((r.ban_slots if b else 0 for r, b in zip(rows, banned)), np.int32, nr)
        H = hasher.max_ngram_size - 1 if hasher is not None else 0
        spec_prev = np.full(num_rows, -1, np.int32)
        spec_ctx = np.full((num_rows, H + K), -1, np.int32)
        for i in np.flatnonzero(device_R):
            spec_prev[i] = rows[i].prev_row
            spec_ctx[i, :len(rows[i].spec_ctx)] = rows[i].spec_ctx
    else:
        logit_rows = np.full(num_rows, -1, np.int64)
        if nr and sample_R.all():
            logit_rows[:nr] = last_t
        else:
            logit_rows[:nr] = np.where(sample_R, last_t, -1)

    targets = None
    if prompt_lp:
        targets = np.zeros(num_tokens, np.int32)
        plp_rows = np.full(num_tokens, -1, np.int64)
        for i in (i for i, r in enumerate(rows) if r.prompt_logprobs):
            o, m = int(off_R[i]), len(rows[i].prompt_targets)  # tokens whose next token is in the prompt
            plp_rows[o:o + m] = np.arange(o, o + m)
            targets[o:o + m] = rows[i].prompt_targets
        logit_rows = np.concatenate([logit_rows, plp_rows])
    cc = cache_config
    floor_R = np.fromiter(map(_floor, rows), np.int64, nr)
    batch = pack_batch(
        tok_t, n_R, start_R, np.fromiter(map(_slot, rows), np.int64, nr), list(map(_blocks, rows)),
        floor_R, np.maximum(floor_R, np.fromiter(map(_dec_floor, rows), np.int64, nr)),
        np.fromiter(map(_cache_start, rows), np.int64, nr), engram_ids=eids,
        num_tokens=num_tokens, num_rows=num_rows, max_blocks=cc.max_blocks_per_seq, num_slots=cc.num_slots,
        n_engram_layers=n_layers, n_hash_cols=hasher.n_hash_cols if hasher is not None else 0,
        logits=logit_rows, num_logits=len(logit_rows), num_decoder_tokens=num_decoder_tokens,
        cp_devices=cp_devices, one_token_rows=one)
    # sampler row i is the plan's row i; rows that do not sample are greedy padding
    if num_banned is None:
        num_banned = _banned_width(banned)
    pos_R = start_R + n_R  # ScheduledRow.sample_position
    if nd_R is not None:
        pos_R -= nd_R
    if nr and sample_R.all():  # (usually every row samples)
        samp_R, srows, sbanned = arange_of(nr), rows, banned
    else:
        samp_R = np.flatnonzero(sample_R)
        srows = [rows[i] for i in samp_R]
        sbanned = [banned[i] for i in samp_R]
        pos_R = pos_R[samp_R]
    sampling = sampling_batch_of(samp_R, list(map(_params, srows)), list(map(_seed, srows)), pos_R,
                                 sbanned, num_rows, vocab, num_banned=num_banned, reuse=reuse)
    # one compiled sampler for every batch composition (no static fast paths)
    sampling.all_greedy, sampling.needs_filter = False, True
    allowed = None
    masks = sched.grammar_masks
    if with_masks if with_masks is not None else bool(masks):
        masks = masks or {}
        W = -(-vocab // 32)
        allowed = np.full((num_rows, Kv + 1, W), -1, np.int32)
        for i, m in masks.items():
            m = np.asarray(m, np.int32)
            allowed[i, :len(m)] = m
            allowed[i, len(m):] = 0  # slots past the row's drafts are never emitted
        if not K:
            allowed = allowed[:, 0]
    return StepInput(batch, sampling, prev, partials, targets, draft_RK=drafts, num_drafts_R=n_drafts,
                     ban_slots_R=ban_slots, spec_prev_row_R=spec_prev, spec_ctx_RC=spec_ctx, allowed_RW=allowed)


def _decode_step_input(d, *, spec_slots: int, num_tokens: int, num_rows: int, num_decoder_tokens: int | None,
                       cache_config, hasher, vocab: int, num_banned: int | None, with_masks: bool,
                       cp_devices: int | None, reuse: SamplingReuse | None) -> StepInput:
    """``build_step_input`` of a step whose rows are all decode columns (``sched.decode``): the
    same arrays, read from the columns instead of from row objects (``tests/test_decode_cohort.py``
    compares the two). Each row is one token: without speculation a placeholder (the previous
    step's sample, ``prev``) with its Engram partial hash from the row's look-back; in a plain step
    of a speculative engine (``spec_slots`` > 0, ``verify_slots=0``) a device row, resolved on the
    device from the previous step's carry (its previous row in ``spec_prev_row_R``, its look-back
    in ``spec_ctx_RC``)."""
    nr = len(d)
    rows_R = arange_of(nr)
    n_layers = hasher.n_layers if hasher is not None else 0
    H = hasher.max_ngram_size - 1 if hasher is not None else 0
    prev = np.full(num_tokens, -1, np.int32)
    partials = np.zeros((num_tokens, n_layers, H, 2), np.uint32) if hasher is not None else None
    if not spec_slots:
        prev[:nr] = d.prev_R
        if hasher is not None and nr:
            partials[:nr] = _placeholder_partials(hasher, d.history_RH)
    logit_rows = np.full(num_rows, -1, np.int64)
    logit_rows[:nr] = rows_R
    cc = cache_config
    batch = pack_batch(
        np.zeros(nr, np.int64), np.ones(nr, np.int64), d.start_R, d.slot_R, d.blocks, d.floor_R,
        np.maximum(d.floor_R, d.dec_floor_R), d.cache_start_R, engram_ids=None,
        num_tokens=num_tokens, num_rows=num_rows, max_blocks=cc.max_blocks_per_seq, num_slots=cc.num_slots,
        n_engram_layers=n_layers, n_hash_cols=hasher.n_hash_cols if hasher is not None else 0,
        logits=logit_rows, num_logits=num_rows, num_decoder_tokens=num_decoder_tokens,
        cp_devices=cp_devices, one_token_rows=True)
    sampling = sampling_batch_of(rows_R, d.params, d.seeds, d.start_R + 1, (), num_rows, vocab,
                                 num_banned=NUM_BANNED if num_banned is None else num_banned, reuse=reuse)
    sampling.all_greedy, sampling.needs_filter = False, True
    W = -(-vocab // 32)
    if not spec_slots:
        allowed = np.full((num_rows, W), -1, np.int32) if with_masks else None
        return StepInput(batch, sampling, prev, partials, None, allowed_RW=allowed)
    spec_prev = np.full(num_rows, -1, np.int32)
    spec_prev[:nr] = d.prev_R
    spec_ctx = np.full((num_rows, H + spec_slots), -1, np.int32)
    if H:
        spec_ctx[:nr, :H] = d.history_RH
    allowed = np.full((num_rows, 1, W), -1, np.int32) if with_masks else None
    return StepInput(batch, sampling, prev, partials, None,
                     draft_RK=np.zeros((num_rows, 0), np.int32), num_drafts_R=np.zeros(num_rows, np.int32),
                     ban_slots_R=np.zeros(num_rows, np.int32), spec_prev_row_R=spec_prev, spec_ctx_RC=spec_ctx,
                     allowed_RW=allowed)


def _placeholder_partials(hasher, hist_RK: np.ndarray) -> np.ndarray:
    """Partial Engram hashes of one placeholder per row whose look-back ``hist_RK`` (the
    ``max_ngram_size - 1`` known tokens before it, oldest first) is full: each window is the
    placeholder itself (on the device, -1 here), then the look-back newest first."""
    win_tK = np.empty((hist_RK.shape[0], hist_RK.shape[1] + 1), np.int64)
    win_tK[:, 0] = -1
    win_tK[:, 1:] = hist_RK[:, ::-1]
    return window_partials(hasher, win_tK)


def _engram_ids(rows, hasher, n_R, off_R, start_R, ph_R, device_R, row_of_t, last_t, partials_TLK2,
                one: bool = False) -> np.ndarray | None:
    """Engram table rows of every known token of the host-hashed rows ([total, layers, cols],
    zeros elsewhere; None: no known token, all zeros), and (into ``partials_TLK2``) the partial
    hashes of their placeholders. ``device_R``: None when every row is host-hashed; ``one``:
    every row has one token (``off_R`` = ``row_of_t`` = ``last_t`` = 0..nr-1).

    A row's ``history`` holds the known tokens of positions ``[w0, start + known)``, ``w0 =
    max(start - (K-1), 0)``: every look-back of its tokens. All rows' histories are
    concatenated and each token's window ``[p, p-1, ..., p-K+1]`` gathered from there (-1 before
    position 0)."""
    Km1 = hasher.max_ngram_size - 1
    nr = len(rows)
    known_R = n_R - ph_R
    w0_R = np.maximum(start_R - Km1, 0)
    if device_R is None:  # (the common case: no device rows)
        hist = list(map(_history, rows))
    else:
        hist = [rows[i].history if not device_R[i] else () for i in range(nr)]
    try:
        hl_R = np.fromiter(map(len, hist), np.int64, nr)
    except TypeError:  # a row without history (-1: named below)
        hl_R = np.fromiter((len(h) if h is not None else -1 for h in hist), np.int64, nr)
    want_R = start_R + known_R - w0_R
    bad = hl_R != want_R if device_R is None else ~device_R & (hl_R != want_R)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"row of request {rows[i].request_id!r}: history holds "
                         f"{None if hist[i] is None else len(hist[i])} tokens, Engram needs "
                         f"{int(start_R[i] + known_R[i] - w0_R[i])} (Scheduler(history_tokens={Km1}))")
    if device_R is not None:
        hl_R = np.where(device_R, 0, hl_R)
    hist_flat = concat_ints(hist, int(hl_R.sum()))
    if one and device_R is None and nr and int(start_R.min()) >= Km1:
        # one-token rows past the first K-1 positions (decode steps): every history is the
        # full look-back (plus the token when known), so the windows are its rows reversed
        n_ph = int(ph_R.sum())
        if n_ph == nr:  # every token a placeholder (async decode): partial hashes only
            partials_TLK2[:nr] = _placeholder_partials(hasher, hist_flat.reshape(nr, Km1))
            return None
        if n_ph == 0:  # every token known (sync decode)
            return hasher.hash_windows(hist_flat.reshape(nr, Km1 + 1)[:, ::-1])
    host_R = ~device_R if device_R is not None else np.ones(nr, bool)
    hoff_R = np.zeros(nr, np.int64)
    np.cumsum(hl_R[:-1], out=hoff_R[1:])
    total = row_of_t.shape[0]
    pos_t = start_R[row_of_t] + np.arange(total) - off_R[row_of_t]
    src_tK = pos_t[:, None] - np.arange(Km1 + 1)[None, :]          # positions p - k
    idx_tK = hoff_R[row_of_t][:, None] + src_tK - w0_R[row_of_t][:, None]
    is_ph_t = np.zeros(total, bool)
    is_ph_t[last_t[ph_R]] = True
    host_t = host_R[row_of_t]
    known_t = host_t & ~is_ph_t
    win_tK = np.full((total, Km1 + 1), -1, np.int64)
    look = (src_tK >= 0) & (host_t[:, None])
    look[is_ph_t, 0] = False  # the placeholder's own token is on the device
    win_tK[look] = hist_flat[idx_tK[look]]
    eids = None
    if known_t.any():
        eids = np.zeros((total, hasher.n_layers, hasher.n_hash_cols), np.int64)
        eids[known_t] = hasher.hash_windows(win_tK[known_t])
    if is_ph_t.any():
        partials_TLK2[:total][is_ph_t] = window_partials(hasher, win_tK[is_ph_t])
    return eids
