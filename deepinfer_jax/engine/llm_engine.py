"""LLMEngine: requests in, ``RequestOutput``s out, one ``step()`` at a time.

One round of ``step()`` (FEATURES §3), asynchronous by default:

1. ``Scheduler.schedule()`` plans step N from what the host knows; decode tokens sampled by the
   in-flight step N-1 enter as placeholders.
2. ``ModelRunner.execute()`` dispatches step N (forward + sampling) and returns at once.
3. The results of step N-1 are fetched and processed (detokenize, stop checks, logprobs, free
   finished requests) while step N runs.

With ``async_scheduling=False`` step N's results are processed in the same round, before step
N+1 is planned. Both orders produce identical tokens: sampling is seeded per (request seed,
position), and each dispatched step computes the same rows either way. A sample of a request
that finished (or was preempted) in the meantime is dropped; the pairing of a result with its
request is the row's request id and ``epoch`` (unique per admission: see the scheduler); rows
are plain data, so the engine looks the request up by id.
"""

from __future__ import annotations

import time

import numpy as np

from deepinfer_jax.engine.output_processor import OutputProcessor, RequestState
from deepinfer_jax.engine.outputs import RequestOutput
from deepinfer_jax.engine.stats import StatsLogger, StepStats
from deepinfer_jax.host_scheduler.request import Request, RequestStatus
from deepinfer_jax.host_scheduler.scheduler import Scheduler

_MASK63 = (1 << 63) - 1


def child_seed(seed: int, index: int) -> int:
    """Seed of sample ``index`` of a request with ``n > 1`` (sample 0 keeps the request seed)."""
    if index == 0:
        return seed
    x = (seed + 0x9E3779B97F4A7C15 * index) & ((1 << 64) - 1)  # splitmix64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (x ^ (x >> 31)) & _MASK63


class LLMEngine:
    def __init__(self, runner, ec, tokenizer=None, eos_token_id: int | None = None):
        """``runner``: a ``ModelRunner`` (or anything with ``execute(sched) -> handle``);
        ``ec``: the resolved ``EngineConfig``."""
        self.runner, self.ec, self.tokenizer = runner, ec, tokenizer
        self.eos_token_id = eos_token_id
        self.scheduler = Scheduler(ec, history_tokens=getattr(runner, "history_tokens", 0))
        self.outputs = OutputProcessor(tokenizer, ec.max_model_len)
        self.stats = StatsLogger()
        self._states: dict[str, RequestState] = {}
        self._groups: dict[str, list[RequestState]] = {}
        self._prompts: dict[str, str | None] = {}
        self._inflight = None
        self._rng = np.random.default_rng(ec.seed)

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt_token_ids: list[int], params, prompt: str | None = None,
                    arrival_time: float | None = None) -> None:
        """Queue a validated request (``params.n`` samples share the prompt)."""
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**63 - 1))
        states = []
        for i in range(params.n):
            rid = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(rid, list(prompt_token_ids), params, child_seed(seed, i), self.eos_token_id)
            if arrival_time is not None:
                req.arrival_time = arrival_time
            st = self.outputs.new_state(req, request_id, i)
            self._states[rid] = st
            states.append(st)
            self.scheduler.add_request(req)
        self._groups[request_id] = states
        self._prompts[request_id] = prompt
        self.stats.prompt_tokens += len(prompt_token_ids) * params.n

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Finish every sample of ``request_id`` with "abort" (their blocks and slots are freed;
        results still in flight are dropped) and return its output, or None if unknown."""
        if request_id not in self._groups:
            return None
        for st in self._groups[request_id]:
            if not st.request.status.finished:
                self.outputs.finish_text(st, RequestStatus.FINISHED_ABORTED)
                self.scheduler.finish(st.request, RequestStatus.FINISHED_ABORTED)
        out = self._request_output(request_id)
        self._forget([request_id])
        return out

    def _forget(self, parent_ids) -> None:
        for g in parent_ids:
            for s in self._groups.pop(g):
                self._states.pop(s.request.request_id, None)
            self._prompts.pop(g, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """One round; returns the requests (all ``n`` samples) that finished in it."""
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        handle = self.runner.execute(sched) if sched.rows else None
        if handle is not None:
            handle.host_time = time.perf_counter() - t0
        finished: list[RequestOutput] = []
        progressed = handle is not None
        if self.ec.async_scheduling:
            prev, self._inflight = self._inflight, handle
            if prev is not None:
                progressed = True  # its results may finish requests and free slots / blocks
                finished += self._process(prev)
        elif handle is not None:
            finished += self._process(handle)
        if not progressed and self.scheduler.has_unfinished():
            raise RuntimeError("scheduler made no progress with nothing in flight "
                               f"({len(self.scheduler.waiting)} waiting, {len(self.scheduler.running)} running)")
        return finished

    def _process(self, handle) -> list[RequestOutput]:
        res = handle.fetch()
        sched = handle.sched
        done_groups = []
        now = time.monotonic()
        for i, row in enumerate(sched.rows):
            st = self._states.get(row.request_id)
            req = st.request if st is not None else None
            if req is None or req.status.finished or row.epoch != req.epoch:
                continue  # finished, aborted or preempted since this step was planned
            if row.prompt_logprobs and res.prompt_target_lp is not None:
                off = res.token_offsets[i]
                for j in range(row.num_tokens):
                    p = row.start + j + 1
                    if p < len(req.prompt_token_ids):
                        self.outputs.add_prompt_logprobs(st, p, res.prompt_target_lp[off + j],
                                                         res.prompt_top_ids[off + j], res.prompt_top_lp[off + j])
            if not row.sample:
                continue
            req.num_pending -= 1
            if req.first_token_time is None:
                req.first_token_time = now
            status = self.outputs.add_token(st, int(res.token_ids[i]), float(res.logprob[i]),
                                            res.top_ids[i], res.top_logprobs[i])
            self.stats.generated_tokens += 1
            if status is not None:
                self.outputs.finish_text(st, status)
                self.scheduler.finish(req, status)
                group = self._groups[st.parent_id]
                if all(s.request.status.finished for s in group):
                    done_groups.append(st.parent_id)
        self.stats.record(StepStats(
            step_id=sched.step_id, num_tokens=sched.num_tokens, bucket_tokens=handle.bucket_tokens,
            num_prefill_tokens=sched.num_prefill_tokens, num_decode_tokens=sched.num_decode_tokens,
            num_rows=len(sched.rows), step_time_s=handle.t_done - handle.t_dispatch,
            host_time_s=handle.host_time, cache_hit_tokens=sched.cache_hit_tokens,
            preemptions=len(sched.preempted), queue_wait_s=list(sched.queue_wait)))
        out = [self._request_output(g) for g in done_groups]
        self._forget(done_groups)
        self.stats.finished_requests += len(done_groups)
        return out

    def _request_output(self, parent_id: str) -> RequestOutput:
        states = self._groups[parent_id]
        first = states[0]
        comps = [self.outputs.completion(s) for s in states]
        return RequestOutput(parent_id, self._prompts.get(parent_id), list(first.request.prompt_token_ids),
                             first.prompt_logprobs, comps, True, comps[0].metrics,
                             first.request.num_cached_tokens)

    def run_until_done(self, on_finish=None) -> list[RequestOutput]:
        outs = []
        t0 = time.perf_counter()
        while self.has_unfinished_requests():
            for o in self.step():
                outs.append(o)
                if on_finish is not None:
                    on_finish(o)
        self.stats.wall_time_s += time.perf_counter() - t0
        return outs
