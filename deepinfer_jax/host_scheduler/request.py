"""A request as the host scheduler sees it: its tokens, sampling settings and cache bookkeeping.

Counting, in positions of the request's sequence:

* ``all_token_ids``: the tokens the host knows (prompt + processed outputs).
* ``num_pending``: tokens dispatched to the device but not yet processed, counted
  optimistically: one per sample, 1 + drafts per verification row (async scheduling keeps at
  most two rows in flight while a round is being scheduled). The sequence length the
  scheduler plans with is ``num_tokens_planned = len(all_token_ids) + num_pending``.
* ``num_computed``: positions already scheduled into the caches (optimistic: includes steps
  still in flight). A request decodes when ``num_computed == num_tokens_planned - 1``.
* ``epoch``: set by the scheduler on admission and on every preemption, unique across requests;
  results of steps dispatched in an older epoch (or for an earlier request of the same id) are dropped.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import Any


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self._value_ in _FINISHED  # (by value: an enum member hashes in Python, a str in C)


_FINISHED = frozenset(s.value for s in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                                        RequestStatus.FINISHED_ABORTED))


@dataclasses.dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: Any                       # sampling.SamplingParams
    seed: int                         # the request's sampling seed (given or drawn by the engine)
    eos_token_id: int | None = None
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    # --- outputs ---
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    # --- scheduling state ---
    num_computed: int = 0
    num_pending: int = 0
    last_sample: tuple[int, int] | None = None  # (step id, logits row) of the newest in-flight sample
    epoch: int = 0
    slot: int | None = None
    # replaced, never changed in place: the rows planned from it share the list
    blocks: list[int] = dataclasses.field(default_factory=list)
    floor: int = 0                    # first window position visible (replay start after a hit)
    dec_floor: int = 0                # YOCO: first position the decoder layers compute
    cache_start: int = 0              # first position whose compressed entries this request writes
    block_hashes: list[int] = dataclasses.field(default_factory=list)  # of full known blocks
    num_registered_blocks: int = 0    # blocks handed to the prefix cache
    # --- speculative decoding (sync: the newest step's drafts for the next verification) ---
    draft_token_ids: list[int] = dataclasses.field(default_factory=list)
    draft_confidence: list[float] = dataclasses.field(default_factory=list)  # logits, per draft
    spec_inflight_drafts: int = 0     # drafts of the newest planned row (its accepted prefix feeds the next)
    # --- metrics ---
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0        # prompt tokens the prefix cache saved: the replay start (first admission)
    num_preemptions: int = 0
    num_drafts_proposed: int = 0      # drafts the DSpark stages produced for this request
    num_drafts_verified: int = 0      # drafts scheduled into verification rows
    num_drafts_accepted: int = 0
    drafts_accepted_per_position: list[int] = dataclasses.field(default_factory=list)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_planned(self) -> int:
        return self.num_tokens + self.num_pending

    @property
    def num_outputs_planned(self) -> int:
        return len(self.output_token_ids) + self.num_pending

    @property
    def is_prefill(self) -> bool:
        return self.num_computed < self.num_tokens_planned - 1

    def known_tokens(self, start: int, end: int) -> list[int]:
        """Known tokens of positions ``[start, end)`` (clipped to what the host knows), without
        building the whole history: per-step host work stays independent of the context length."""
        n_p = len(self.prompt_token_ids)
        out = self.prompt_token_ids[start:min(end, n_p)]
        if end > n_p:
            out = out + self.output_token_ids[max(start - n_p, 0):end - n_p]
        return out

    def token_at(self, position: int) -> int | None:
        """The token at ``position`` if the host knows it, else None (an in-flight sample)."""
        n_p = len(self.prompt_token_ids)
        if position < n_p:
            return self.prompt_token_ids[position]
        i = position - n_p
        return self.output_token_ids[i] if i < len(self.output_token_ids) else None
