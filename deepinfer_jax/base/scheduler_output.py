"""What the scheduler hands the runner for one step: plain data (ids, positions, token ids,
slots, block tables, floors, sampling values), no live scheduler object. It lives below both
rooms (``host_scheduler`` writes it, ``runner`` reads it, neither imports the other) and
pickles, so the same data can cross a process boundary (server, disaggregated prefill/decode,
DP replicas)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any


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


@dataclasses.dataclass
class SchedulerOutput:
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

    @functools.cached_property
    def _counts(self) -> tuple[int, int, int, bool]:
        """(tokens, prompt tokens, decoder tokens, whether a row wants prompt logprobs) of the
        step, in one pass over the rows (the rows are not changed once planned)."""
        total = prefill = decoder = 0
        plp = False
        for r in self.rows:
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
        return sum(r.num_drafts for r in self.rows)

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self._counts[3]
