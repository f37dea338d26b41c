"""Host side of one jitted step: a ``SchedulerOutput`` -> padded numpy arrays (``StepInput``).

Shapes are fixed by the bucket: T tokens (a ``token_buckets`` size), R = ``max_num_seqs`` rows,
optionally T' decoder tokens (compact YOCO truncation). Every row gets one logits row (row r of
the sampler); rows that do not sample are padding for the sampler. With prompt logprobs the
logits rows continue with one row per flat token (``R + T`` in all).

Verification rows (speculative decoding, ``spec_slots = K > 0``): every row gets K+1 logits rows
(``R*(K+1)`` sampler slots in all, row r's slot i at the token of its i-th verification position,
slots past the row's drafts repeat its last token) and ``draft_RK`` / ``num_drafts_R`` carry the
drafts being judged.

Placeholders: a decode token sampled by the previous step is not known here; its entry in
``prev_row`` names the previous step's logits row and the device substitutes the id (and, with
Engram, finishes its hash from ``engram_partials``).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from deepinfer_jax.runner.engram_hash_device import host_partials
from deepinfer_jax.base.forward_batch import ForwardBatch, RowSpec, build_batch
from deepinfer_jax.sampling.params import SamplingParams
from deepinfer_jax.sampling.sampler import SampleRow, SamplingBatch, build_sampling_batch


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
    # async speculation: the previous step's row whose outputs give this row's tokens (-1: the
    # host knows them), and the n-gram context: H known tokens + that row's drafts (-1 padded)
    spec_prev_row_R: jax.Array | None = None   # int32 [R]
    spec_ctx_RC: jax.Array | None = None       # int32 [R, H + K]
    # structured output: int32 bitmask per sampler row, [R, W] (plain) or [R, K+1, W] (spec);
    # -1 words (all allowed) for rows without a grammar; None when no row of the step has one
    allowed_RW: jax.Array | None = None


NUM_BANNED = 8  # banned ids per sampler row (EOS + stop ids under min_tokens); more recompiles
_PAD_ROW = SampleRow(SamplingParams(temperature=0.0), 0, 0, ())


def pick_bucket(n: int, buckets) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} tokens exceed the largest bucket {buckets[-1]}")


def build_step_input(sched, *, num_tokens: int, num_rows: int, num_decoder_tokens: int | None,
                     cache_config, hasher, vocab: int, prompt_lp: bool, spec_slots: int = 0) -> StepInput:
    """Pad ``sched.rows`` (plain ``ScheduledRow`` data) into a ``StepInput`` of the given bucket sizes."""
    specs, prev = [], np.full(num_tokens, -1, np.int32)
    n_layers = hasher.n_layers if hasher is not None else 0
    partials = None
    if hasher is not None:
        partials = np.zeros((num_tokens, n_layers, hasher.max_ngram_size - 1, 2), np.uint32)
    targets = np.zeros(num_tokens, np.int32) if prompt_lp else None
    logit_rows = []
    plp_rows = np.full(num_tokens, -1, np.int64)
    sample_rows = []
    K = spec_slots
    drafts = np.zeros((num_rows, K), np.int32) if K else None
    n_drafts = np.zeros(num_rows, np.int32) if K else None
    H = hasher.max_ngram_size - 1 if hasher is not None else 0
    spec_prev = np.full(num_rows, -1, np.int32) if K else None
    spec_ctx = np.full((num_rows, H + K), -1, np.int32) if K else None
    o = 0
    for i, r in enumerate(sched.rows):
        n = r.num_tokens
        toks = list(r.token_ids)
        eids = None
        device_row = K > 0 and r.spec_ctx is not None
        if device_row:  # every token and its n-gram hash come from the previous step on the device
            spec_prev[i] = r.prev_row
            spec_ctx[i, :len(r.spec_ctx)] = r.spec_ctx
            toks = [0] * n
            if hasher is not None:
                eids = np.zeros((n, n_layers, hasher.n_hash_cols), np.int64)
        elif hasher is not None:
            # an n-gram hash looks back K-1 tokens: the row carries that window of the history
            w0 = max(r.start - (hasher.max_ngram_size - 1), 0)
            known = n - (1 if r.prev_row >= 0 else 0)
            if r.history is None or len(r.history) != r.start + known - w0:
                raise ValueError(f"row of request {r.request_id!r}: history holds "
                                 f"{None if r.history is None else len(r.history)} tokens, Engram needs "
                                 f"{r.start + known - w0} (Scheduler(history_tokens={hasher.max_ngram_size - 1}))")
            hist = np.asarray(r.history, np.int64)
            eids = np.zeros((n, n_layers, hasher.n_hash_cols), np.int64)
            if known:
                eids[:known] = hasher.hash_positions(hist, np.arange(r.start, r.start + known) - w0)
            if r.prev_row >= 0:
                partials[o + n - 1] = host_partials(hasher, hist, r.start + n - 1 - w0)[0]
        if r.prev_row >= 0 and not device_row:
            prev[o + n - 1] = r.prev_row
            toks[-1] = 0
        specs.append(RowSpec(toks, r.start, r.slot, r.blocks, eids, floor=r.floor, dec_floor=r.dec_floor,
                             cache_start=r.cache_start))
        if K:
            l = r.num_drafts
            if l > K:
                raise ValueError(f"row of request {r.request_id!r}: {l} drafts > spec_slots={K}")
            first = o + n - 1 - l
            logit_rows += [first + min(j, l) if r.sample else -1 for j in range(K + 1)]
            if l:
                if not device_row:
                    drafts[i, :l] = r.token_ids[n - l:]
                n_drafts[i] = l
        else:
            logit_rows.append(o + n - 1 if r.sample else -1)
        if prompt_lp and r.prompt_logprobs:
            m = len(r.prompt_targets)  # tokens whose next token is in the prompt
            plp_rows[o:o + m] = np.arange(o, o + m)
            targets[o:o + m] = r.prompt_targets
        if r.sample:
            sample_rows.append((i, SampleRow(r.params, r.seed, r.sample_position, tuple(r.banned))))
        o += n
    logit_rows += [-1] * (num_rows * (K + 1) - len(logit_rows))
    if prompt_lp:
        logit_rows += [int(t) for t in plp_rows]
    cc = cache_config
    batch = build_batch(specs, num_tokens=num_tokens, num_rows=num_rows, max_blocks=cc.max_blocks_per_seq,
                        num_slots=cc.num_slots, n_engram_layers=n_layers,
                        n_hash_cols=hasher.n_hash_cols if hasher is not None else 0,
                        logits=logit_rows, num_logits=len(logit_rows), num_decoder_tokens=num_decoder_tokens)
    rows = [_PAD_ROW] * num_rows
    for i, sr in sample_rows:
        rows[i] = sr
    longest = max((len(sr.banned) for _, sr in sample_rows), default=0)
    sampling = build_sampling_batch(rows, num_rows, vocab, num_banned=max(NUM_BANNED, longest))
    # one compiled sampler for every batch composition (no static fast paths)
    sampling = dataclasses.replace(sampling, all_greedy=False, needs_filter=True)
    allowed = None
    masks = sched.grammar_masks
    if masks:
        W = -(-vocab // 32)
        allowed = np.full((num_rows, K + 1, W), -1, np.int32)
        for i, m in masks.items():
            m = np.asarray(m, np.int32)
            allowed[i, :len(m)] = m
            allowed[i, len(m):] = 0  # slots past the row's drafts are never emitted
        if not K:
            allowed = allowed[:, 0]
    return StepInput(batch, sampling, prev, partials, targets, drafts, n_drafts, spec_prev, spec_ctx, allowed)
