"""Attention-DP scheduling (``host_scheduler/dp_scheduler.py``) against the JAX-free fake device.

Each dp rank gets its own ``FakeRunner`` (``test_scheduler.py``): it holds that rank's slots and
blocks and checks every cache rule of every row, so a row sent to the wrong rank, a placeholder
naming another rank's row or a block id of another rank's pool fails there. The fake's tokens
are a function of the request's seed and its whole history, so the outputs of a DP engine must
equal a single scheduler's, whatever rank each request ran on, with chunked prompts, prefix
hits, preemptions and async steps.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from deepinfer_jax.base.scheduler_output import SchedulerOutput
from deepinfer_jax.engine.llm_engine import LLMEngine
from deepinfer_jax.host_scheduler.dp_scheduler import DPScheduler
from deepinfer_jax.host_scheduler.request import Request

from test_scheduler import (EOS, FakeResult, FakeRunner, make_ec, mixed_workload, params, preemption_workload, rand_prompt,
                            run, tokens_of)


class DPFakeHandle:
    def __init__(self, sched, parts, n_logprobs: int):
        self.sched, self._parts, self._n = sched, parts, n_logprobs
        self.t_dispatch, self.t_done = time.perf_counter(), None
        self.bucket_tokens = max(h.bucket_tokens for _, _, h in parts)
        self.inputs_time = self.call_time = 0.0

    def fetch(self) -> FakeResult:
        """The ranks' results merged in the plan's row order (as the DP runner's row map does)."""
        n_rows, N = len(self.sched.rows), self._n
        tok, lp = np.zeros(n_rows, np.int32), np.zeros(n_rows, np.float32)
        top_ids, top_lp = np.zeros((n_rows, N), np.int32), np.zeros((n_rows, N), np.float32)
        offsets = [0] * n_rows
        plp = self.sched.wants_prompt_logprobs
        T = self.sched.num_tokens
        tgt, p_ids, p_lp = (np.zeros(T, np.float32), np.zeros((T, N), np.int32), np.zeros((T, N), np.float32)) \
            if plp else (None, None, None)
        tok_first = 0
        for runner, first, h in self._parts:
            runner.next_fetch = h.sched.step_id   # a rank's fake sees only the steps it has rows in
            r = h.fetch()
            n = len(h.sched.rows)
            tok[first:first + n], lp[first:first + n] = r.token_ids[:n], r.logprob[:n]
            top_ids[first:first + n], top_lp[first:first + n] = r.top_ids[:n], r.top_logprobs[:n]
            for j in range(n):
                offsets[first + j] = tok_first + r.token_offsets[j]
            if plp and r.prompt_target_lp is not None:
                m = h.sched.num_tokens
                tgt[tok_first:tok_first + m] = r.prompt_target_lp
                p_ids[tok_first:tok_first + m], p_lp[tok_first:tok_first + m] = r.prompt_top_ids, r.prompt_top_lp
            tok_first += h.sched.num_tokens
        self.t_done = time.perf_counter()
        return FakeResult(tok, lp, top_ids, top_lp, tgt, p_ids, p_lp, offsets)


class DPFakeRunner:
    """``dp`` fake devices, one per rank, fed the rank's rows of each step."""

    def __init__(self, ec, dp: int):
        self.ec, self.dp = ec, dp
        self.ranks = [FakeRunner(ec) for _ in range(dp)]
        self.history_tokens = self.ranks[0].history_tokens
        self.rows_per_rank = [0] * dp

    def attach(self, scheduler: DPScheduler) -> None:
        for f, s in zip(self.ranks, scheduler.ranks):
            f.attach(s)

    def execute(self, sched) -> DPFakeHandle:
        assert sched.ranks is not None and len(sched.ranks) == self.dp and sum(sched.ranks) == len(sched.rows)
        parts, first = [], 0
        for k, n in enumerate(sched.ranks):
            rows = sched.rows[first:first + n]
            if rows:
                f = self.ranks[k]
                f.last_step = sched.step_id - 1
                sub = SchedulerOutput(sched.step_id, rows, [], 0, [])
                parts.append((f, first, f.execute(sub)))
                self.rows_per_rank[k] += n
            else:  # the DP step still runs on this rank: padding rows overwrite its sampled ids
                self.ranks[k].prev_sampled = [None] * self.ec.max_num_seqs
            first += n
        return DPFakeHandle(sched, parts, self.ec.max_logprobs)


def run_dp(ec, reqs, dp: int, waves=None):
    """Like ``test_scheduler.run`` on ``dp`` ranks; ``waves``: request lists added one after the
    other finishes (so a later wave can hit an earlier one's prefix blocks)."""
    runner = DPFakeRunner(ec, dp)
    eng = LLMEngine(runner, ec, tokenizer=None, eos_token_id=EOS)
    assert isinstance(eng.scheduler, DPScheduler)
    runner.attach(eng.scheduler)
    outs = {}
    for wave in (waves or [reqs]):
        for rid, prompt, p in wave:
            eng.add_request(rid, prompt, p)
        steps = 0
        while eng.has_unfinished_requests():
            for o in eng.step():
                assert o.request_id not in outs
                outs[o.request_id] = o
            steps += 1
            assert steps < 4000, "engine does not finish"
            for s in eng.scheduler.ranks:
                s.pool.check_invariants()
                assert s.pool.num_requests == len(s.running) == s.slots.num_used
    for s in eng.scheduler.ranks:
        assert s.pool.num_used == 0 and s.slots.num_used == 0 and not s.requests
    return outs, eng, runner


@pytest.mark.parametrize("dp", [2, 3])
@pytest.mark.parametrize("async_sched", [True, False], ids=["async", "sync"])
def test_dp_outputs_equal_one_scheduler(dp, async_sched):
    """A mixed workload (prompts of 1-300 tokens, chunked under a 64-token budget per rank, EOS,
    stop ids, min_tokens) gives every request the single scheduler's tokens, and every rank
    serves requests."""
    ec = make_ec(async_scheduling=async_sched)
    reqs = mixed_workload()
    ref, *_ = run(ec, reqs)
    outs, eng, runner = run_dp(ec, reqs, dp)
    assert tokens_of(outs) == tokens_of(ref)
    assert all(n > 0 for n in runner.rows_per_rank), runner.rows_per_rank


@pytest.mark.parametrize("async_sched", [True, False], ids=["async", "sync"])
def test_dp_preemption_recomputes_exactly(async_sched):
    """Blocks short on every rank (20 blocks of 16 tokens per rank for 10 long requests):
    requests are preempted and recomputed on their own rank; outputs equal an unconstrained
    single scheduler's, and every request's preemptions are counted."""
    kw = dict(max_model_len=256, async_scheduling=async_sched)
    reqs = preemption_workload()
    ref, *_ = run(make_ec(**kw), reqs)
    outs, eng, _ = run_dp(make_ec(num_blocks=20, **kw), reqs, dp=2)
    assert eng.scheduler.num_preemptions > 0
    assert tokens_of(outs) == tokens_of(ref)
    assert sum(o.outputs[0].metrics.num_preemptions for o in outs.values()) == eng.scheduler.num_preemptions


def test_prefix_hits_route_to_the_rank_holding_the_blocks():
    """Wave 2 shares 80-token prefixes with wave 1's prompts: each request goes to the rank whose
    prefix cache holds its prefix (so it hits), and outputs equal the single scheduler's."""
    rng = np.random.default_rng(5)
    heads = [rand_prompt(rng, 80) for _ in range(4)]
    wave1 = [(f"a{i}", h + rand_prompt(rng, 5), params(seed=i, max_tokens=4, ignore_eos=True))
             for i, h in enumerate(heads)]
    wave2 = [(f"b{i}", heads[i % 4] + rand_prompt(rng, 7), params(seed=10 + i, max_tokens=4, ignore_eos=True))
             for i in range(6)]
    ec = make_ec(enable_prefix_caching=True, prefix_replay="exact")
    ref, *_ = run(ec, wave1 + wave2)
    rank = {}
    orig = DPScheduler.add_request

    def recording(self, req):
        orig(self, req)
        rank[req.request_id] = self.rank_of[req.request_id]

    DPScheduler.add_request = recording
    try:
        outs, eng, _ = run_dp(ec, None, dp=3, waves=[wave1, wave2])
    finally:
        DPScheduler.add_request = orig
    assert tokens_of(outs) == tokens_of(ref)
    assert len({rank[f"a{i}"] for i in range(4)}) == 3   # wave 1 spread over all ranks
    for i in range(6):
        assert rank[f"b{i}"] == rank[f"a{i % 4}"], f"b{i} not sent to the rank holding its prefix"
        assert outs[f"b{i}"].num_cached_tokens > 0, f"b{i} missed its prefix"


def test_new_requests_go_to_the_least_loaded_rank_and_epochs_are_unique():
    ec = make_ec()
    dps = DPScheduler(ec, 3)
    reqs = [Request(f"r{i}", rand_prompt(np.random.default_rng(i), 10 + 40 * (i % 2)), params(max_tokens=2), seed=i)
            for i in range(7)]
    for r in reqs:
        dps.add_request(r)
    # fewest requests first, then fewest prompt tokens held (prompts alternate 10 / 50 tokens):
    # r0 r1 r2 -> ranks 0 1 2; r3 -> 0 (10 tokens, ties rank 2: lower rank); r4 -> 2; r5 -> 1;
    # r6 -> rank 2, which holds 20 prompt tokens against 60 and 100
    assert [[r.request_id for r in s.waiting] for s in dps.ranks] == [["r0", "r3"], ["r1", "r5"], ["r2", "r4", "r6"]]
    assert len({r.epoch for r in reqs}) == 7    # shared epoch counter
    out = dps.schedule()
    assert out.ranks == tuple(len(s.running) for s in dps.ranks)
    assert [r.request_id for r in out.rows] == [r.request_id for s in dps.ranks for r in s.running]
    assert {r.slot for r in out.rows[:out.ranks[0]]} == set(range(out.ranks[0]))   # slots are rank-local
    with pytest.raises(ValueError, match="dp=0"):
        DPScheduler(ec, 0)
