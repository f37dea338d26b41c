"""What the scheduler hands the runner for one step: plain data (ids, positions, token ids,
slots, block tables, floors, sampling values), no live scheduler object. It lives below both
rooms (``host_scheduler`` writes it, ``runner`` reads it, neither imports the other) and
pickles, so the same data can cross a process boundary (server, disaggregated prefill/decode,
DP replicas)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np


@dataclasses.dataclass(slots=True)
class ScheduledRow:
    """One request's part of a step, as plain data: the runner needs no scheduler object and a
    row pickles across a process boundary. Only window slices of the request's tokens are copied
    (the row's own tokens, the Engram look-back, the chunk's prompt targets), never its history.
    ``Scheduler._row`` builds rows positionally: keep the field order."""

    request_id: str
    epoch: int                 # the request's epoch when planned (unique per admission, see Scheduler)
    start: int                 # position of token_ids[0]
    token_ids: list[int]       # -1 marks the placeholder (always the last token)
    prev_row: int              # previous step's logits row holding the placeholder's id, or -1
    sample: bool               # the chunk reaches the end of the sequence: sample the next token
    slot: int
    blocks: list[int]
    floor: int
    dec_floor: int
    cache_start: int
    is_prefill: bool
    params: Any                # the request's sampling.SamplingParams (plain values, never mutated)
    seed: int                  # the request's sampling seed
    banned: list[int]          # token ids that may not be sampled (min_tokens)
    prompt_logprobs: bool      # return logprobs of the prompt positions in this chunk
    # prompt logprobs: the next prompt token of each of the chunk's first tokens that has one
    prompt_targets: list[int] | None
    # Engram: known tokens of [max(start - history_tokens, 0), start + known), known = the row's
    # tokens less the placeholder; None when the scheduler's history_tokens is 0
    history: list[int] | None
    # speculative decoding: the row's last num_drafts tokens are drafts to verify (the token
    # before them is the request's newest known token); 0 = a plain row
    num_drafts: int = 0
    # async speculation: the row's tokens all come from the previous step's outputs (prev_row);
    # the last history_tokens known tokens then the in-flight row's drafts, for the n-gram hash
    spec_ctx: list[int] | None = None
    # min_tokens ending inside a verification row: the banned ids apply to its first ban_slots
    # slots (slot i samples output number n + i, banned while n + i < min_tokens)
    ban_slots: int = 1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def sample_position(self) -> int:
        """Position of the token sampled by this row (of its first verification slot)."""
        return self.start + len(self.token_ids) - self.num_drafts

    @property
    def num_decoder_tokens(self) -> int:
        first = min(max(self.dec_floor - self.start, 0), len(self.token_ids))
        return len(self.token_ids) - first


@dataclasses.dataclass(frozen=True, eq=False)
class DecodeColumns:
    """The steady async decode rows of a step as columns (``host_scheduler/decode_cohort.py``):
    every row one placeholder token (the previous step's sample of row ``prev_R[i]``), sampling,
    no drafts, no bans, no prompt logprobs, its Engram look-back ``history_RH[i]`` (the
    ``H`` known tokens before ``start_R[i]``). ``rows()`` gives the same ``ScheduledRow``s the
    row path plans for them. The arrays and lists are never changed after planning (the next
    step's columns are new objects)."""

    request_ids: list[str]
    epochs: list[int]
    start_R: np.ndarray         # int64 [R]
    prev_R: np.ndarray          # int64 [R]
    slot_R: np.ndarray          # int64 [R]
    floor_R: np.ndarray         # int64 [R]
    dec_floor_R: np.ndarray     # int64 [R]: max(floor, dec_floor), as ScheduledRow.dec_floor
    cache_start_R: np.ndarray   # int64 [R]
    blocks: list[list[int]]     # each row's block ids (the request's list, replaced on growth)
    params: list[Any]
    seeds: list[int]
    history_RH: np.ndarray | None   # int64 [R, H]; None when the scheduler keeps no history
    # a plain step of a speculative engine: the rows are the row path's device rows (their tokens,
    # position shift and Engram ids resolved on the device from the previous step's carry), the
    # look-back their ``spec_ctx`` instead of their ``history``
    spec: bool = False

    def __len__(self) -> int:
        return len(self.request_ids)

    def __eq__(self, other) -> bool:  # (arrays: compared as the rows they stand for)
        return isinstance(other, DecodeColumns) and self.rows() == other.rows()

    __hash__ = None

    def rows(self) -> list[ScheduledRow]:
        if self.history_RH is not None:
            hist = self.history_RH.tolist()
        else:
            hist = [[] if self.spec else None for _ in range(len(self))]
        spec = self.spec
        return [ScheduledRow(rid, ep, st, [-1], pr, True, sl, bl, fl, dfl, cs, False, p, sd, [], False, None,
                             None if spec else h, 0, h if spec else None, 1)
                for rid, ep, st, pr, sl, bl, fl, dfl, cs, p, sd, h in zip(
                    self.request_ids, self.epochs, self.start_R.tolist(), self.prev_R.tolist(),
                    self.slot_R.tolist(), self.blocks, self.floor_R.tolist(), self.dec_floor_R.tolist(),
                    self.cache_start_R.tolist(), self.params, self.seeds, hist)]


@dataclasses.dataclass
class SchedulerOutput:
    """One step's plan. ``rows`` is every row in order; with ``decode`` (steady decode rows as
    columns) the first ``len(decode)`` rows are those, built as ``ScheduledRow``s only when
    ``rows`` is read, and the rows given to the constructor (``tail_rows``) follow: the runner
    and the engine read the columns instead (``num_rows``, ``tail_rows``)."""

    step_id: int
    rows: list[ScheduledRow]
    preempted: list[str]
    cache_hit_tokens: int      # tokens of rows admitted now that the prefix cache saves (not recomputed)
    queue_wait: list[float]    # seconds in the queue of each request admitted now
    # structured output: row index -> int32 bitmask rows [num_drafts + 1, W] of that row's
    # sampled slots (the engine fills them after planning); None = no grammar row this step
    grammar_masks: dict[int, Any] | None = None
    # attention DP: rows per dp rank, the rows listed rank by rank (host_scheduler/dp_scheduler.py);
    # None = one rank
    ranks: tuple[int, ...] | None = None
    # speculative decoding: a plain step (host_scheduler/spec_switch.py) verifies no drafts and
    # drafts none (one logits row per row, no rollback); False: a verification step
    spec_plain: bool = False
    # the leading steady decode rows as columns (see the class doc); None: every row in ``rows``
    decode: DecodeColumns | None = None

    @property
    def tail_rows(self) -> list[ScheduledRow]:
        """The rows after the ``decode`` columns' (all of them without columns)."""
        return self._tail

    @property
    def num_rows(self) -> int:
        return len(self._tail) + (len(self.decode) if self.decode is not None else 0)

    @functools.cached_property
    def _counts(self) -> tuple[int, int, int, bool]:
        """(tokens, prompt tokens, decoder tokens, whether a row wants prompt logprobs) of the
        step, in one pass over the rows (the rows are not changed once planned)."""
        total = prefill = decoder = 0
        plp = False
        d = self.decode
        if d is not None:  # one token a row: a decoder token where the row starts at or past dec_floor
            total = len(d)
            decoder = int(np.count_nonzero(d.dec_floor_R <= d.start_R))
        for r in self._tail:
            n = len(r.token_ids)
            total += n
            if r.is_prefill:
                prefill += n
            if r.prompt_logprobs:
                plp = True
            # r.num_decoder_tokens, inlined (a property call per row and step)
            skip = r.dec_floor - r.start
            decoder += n if skip <= 0 else n - min(skip, n)
        return total, prefill, decoder, plp

    @property
    def num_tokens(self) -> int:
        return self._counts[0]

    @property
    def num_prefill_tokens(self) -> int:
        return self._counts[1]

    @property
    def num_decode_tokens(self) -> int:
        return self._counts[0] - self._counts[1]

    @property
    def num_decoder_tokens(self) -> int:
        return self._counts[2]

    @property
    def num_draft_tokens(self) -> int:
        return sum(r.num_drafts for r in self._tail)

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self._counts[3]


def _all_rows(self: SchedulerOutput) -> list[ScheduledRow]:
    d = self.decode
    if d is None:
        return self._tail
    full = self.__dict__.get("_all_rows")
    if full is None:
        full = self.__dict__["_all_rows"] = d.rows() + self._tail
    return full


def _set_rows(self: SchedulerOutput, rows: list[ScheduledRow]) -> None:
    self._tail = rows
    self.__dict__.pop("_all_rows", None)


# (a property over the dataclass field: the constructor's ``rows`` are the rows after ``decode``)
SchedulerOutput.rows = property(_all_rows, _set_rows, doc="Every row of the step, in order.")
