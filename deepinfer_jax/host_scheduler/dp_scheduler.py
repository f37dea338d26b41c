"""Attention data parallel on the host: one ``Scheduler`` per dp rank (FEATURES §6).

Each rank owns its requests, their sliding-window slots and their paged blocks; the engine's
``EngineConfig`` sizes (``max_num_seqs``, ``num_blocks``, ``max_num_batched_tokens``) are per
rank, so every rank's scheduler is the single-device one, unchanged. ``DPScheduler`` puts a new
request on one rank for its whole life (a preempted request waits on the same rank, where its
prefix blocks are):

1. the rank whose prefix cache holds the longest prefix of its prompt, if that rank has room
   (fewer requests than ``max_num_seqs``) — the hit is only usable where the blocks are;
2. otherwise the rank with the most free capacity: fewest requests, then fewest tokens (prompt
   tokens of the requests it holds), then the lowest rank.

One ``schedule()`` plans every rank under the same step id (placeholder rows name the previous
step's rows of their own rank) and concatenates the rows, rank by rank; ``SchedulerOutput.ranks``
holds each rank's row count, which the DP runner uses to split them again. Epochs come from one
shared counter, so results of rows of different ranks can never be mistaken for each other.
"""

from __future__ import annotations

import itertools

from deepinfer_jax.base.scheduler_output import SchedulerOutput
from deepinfer_jax.host_scheduler.request import Request, RequestStatus
from deepinfer_jax.host_scheduler.scheduler import Scheduler


class _Pools:
    """What the engine asks of ``scheduler.pool``, over every rank's block pool."""

    def __init__(self, ranks):
        self._ranks = ranks

    def reset_prefix_cache(self) -> None:
        for s in self._ranks:
            s.pool.reset_prefix_cache()


class DPScheduler:
    def __init__(self, ec, dp: int, history_tokens: int = 0, max_model_len: int | None = None):
        if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
            raise ValueError(f"DPScheduler: dp={dp!r}: must be a positive int")
        self.ec, self.dp = ec, dp
        epochs = itertools.count()
        self.ranks = [Scheduler(ec, max_model_len=max_model_len, history_tokens=history_tokens, epochs=epochs)
                      for _ in range(dp)]
        self.rank_of: dict[str, int] = {}
        self._tokens = [0] * dp   # prompt tokens of each rank's requests (the load tie-break)
        self.pool = _Pools(self.ranks)
        self.next_step_id = 0
        self.num_draft_tokens = self.ranks[0].num_draft_tokens
        self.max_model_len = self.ranks[0].max_model_len

    # ------------------------------------------------------------------ views
    @property
    def requests(self) -> dict[str, Request]:
        return {k: v for s in self.ranks for k, v in s.requests.items()}

    @property
    def waiting(self) -> list[Request]:
        return [r for s in self.ranks for r in s.waiting]

    @property
    def running(self) -> list[Request]:
        return [r for s in self.ranks for r in s.running]

    @property
    def num_preemptions(self) -> int:
        return sum(s.num_preemptions for s in self.ranks)

    @property
    def num_device_rows(self) -> int:
        return sum(s.num_device_rows for s in self.ranks)

    @property
    def spec_sps(self):
        return self.ranks[0].spec_sps

    @spec_sps.setter
    def spec_sps(self, fn) -> None:
        for s in self.ranks:
            s.spec_sps = fn

    @property
    def spec_buckets(self):
        return self.ranks[0].spec_buckets

    @spec_buckets.setter
    def spec_buckets(self, buckets) -> None:
        for s in self.ranks:
            s.spec_buckets = buckets

    @property
    def spec_confidence(self):
        return self.ranks[0].spec_confidence

    @spec_confidence.setter
    def spec_confidence(self, fn) -> None:
        for s in self.ranks:
            s.spec_confidence = fn

    # ------------------------------------------------------------------ requests
    def pick_rank(self, req: Request) -> int:
        """The rank a new request goes to (module docstring)."""
        room = [k for k, s in enumerate(self.ranks) if s.num_requests < self.ec.max_num_seqs]
        hits = [(s.prefix_hit_tokens(req), -k) for k, s in enumerate(self.ranks) if k in room]
        best_hit, neg_k = max(hits, default=(0, 0))
        if best_hit > 0:
            return -neg_k
        return min(range(self.dp), key=lambda k: (self.ranks[k].num_requests, self._tokens[k], k))

    def add_request(self, req: Request) -> None:
        if req.request_id in self.rank_of:
            raise ValueError(f"request id {req.request_id!r} is already in the scheduler")
        k = self.pick_rank(req)
        self.ranks[k].add_request(req)
        self.rank_of[req.request_id] = k
        self._tokens[k] += len(req.prompt_token_ids)

    def finish(self, req: Request, status: RequestStatus) -> None:
        k = self.rank_of.get(req.request_id)
        if k is None or req.status.finished:
            return
        self.ranks[k].finish(req, status)
        del self.rank_of[req.request_id]
        self._tokens[k] -= len(req.prompt_token_ids)

    def commit_verification(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        self.ranks[self.rank_of[req.request_id]].commit_verification(req, num_drafts, num_accepted)

    def has_unfinished(self) -> bool:
        return any(s.has_unfinished() for s in self.ranks)

    # ------------------------------------------------------------------ planning
    def schedule(self) -> SchedulerOutput:
        step = self.next_step_id
        outs = []
        for s in self.ranks:
            s.next_step_id = step
            outs.append(s.schedule())
        rows = [r for o in outs for r in o.rows]
        if rows:
            self.next_step_id += 1
        return SchedulerOutput(step, rows, [p for o in outs for p in o.preempted],
                               sum(o.cache_hit_tokens for o in outs), [w for o in outs for w in o.queue_wait],
                               ranks=tuple(len(o.rows) for o in outs))
