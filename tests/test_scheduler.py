"""Continuous-batching scheduler and engine bookkeeping, against a JAX-free fake device.

``FakeRunner`` stands in for ``ModelRunner``: it keeps what the real device would hold (per
sliding-window slot the window state of its request, per paged block the compressed entries of
its positions) and samples deterministic tokens.  The token sampled for a row is a function of
the request seed and the request's full token history up to the sampled position, and that
history is read from the fake *cache* (earlier positions) plus the row's own tokens (with the
placeholder resolved from the previous ``execute`` call's samples, as the device does).  A
scheduler bug (wrong start, wrong token, lost chunk, wrong placeholder, wrong blocks) therefore
changes the output, and the fake also asserts the cache rules directly:

* a row continues exactly where its slot's state ends (same request and epoch, same floor), or
  starts afresh at its floor (admission / replay; floor and cache_start multiples of a block);
* its block table covers ``[0, start + len)``; every position below ``start`` is present in its
  blocks, with the request's own history (a per-position fingerprint of the whole prefix);
* compressed entries are written only at positions ``>= cache_start`` and only into blocks no
  other request references (prefix-shared blocks are read-only); replayed positions below
  ``cache_start`` must match what the shared blocks hold;
* a prefix hit hands out only blocks whose recorded tokens equal the request's tokens;
* a placeholder names a row of the previous step that sampled; samples never exceed
  ``max_tokens`` / ``max_model_len``; the sampled position is at or above the decoder floor.

No test here needs JAX (``deepinfer_jax.sampling`` imports its jitted sampler lazily).
"""

from __future__ import annotations

import dataclasses
import sys
import time

import numpy as np
import pytest

from deepinfer_jax.config import preset
from deepinfer_jax.engine.llm_engine import LLMEngine, child_seed
from deepinfer_jax.engine_config import EngineConfig
from deepinfer_jax.host_scheduler.block_pool import hash_request_blocks
from deepinfer_jax.host_scheduler.request import Request
from deepinfer_jax.host_scheduler.scheduler import Scheduler
from deepinfer_jax.sampling.params import SamplingParams


MODEL_CFG = preset("v41-tiny")  # sliding_window 8, 6 layers, max_position_embeddings 512
V = 48                          # fake vocabulary (small, so EOS / stop ids come up often)
EOS = 5
BT = 16


def make_ec(**kw) -> EngineConfig:
    base = dict(max_num_seqs=8, max_num_batched_tokens=64, block_tokens=BT, max_logprobs=3,
                precompile=False)
    base.update(kw)
    return EngineConfig(**base).resolve(MODEL_CFG)


def params(**kw) -> SamplingParams:
    return SamplingParams(**kw).validate()


def rand_prompt(rng, n: int) -> list[int]:
    return [int(t) for t in rng.integers(1, V, size=n)]


# =========================================================================== the fake device

_FP0 = 0x5EED5EED


def _fp(prev: int, tok: int) -> int:
    """Fingerprint of a history, chained per position (int tuple hashing is deterministic)."""
    return hash((prev, tok)) & 0xFFFFFFFFFFFF


def _draw(seed: int, fp: int) -> int:
    return hash((seed, fp, 0xD1CE)) % V


@dataclasses.dataclass
class RowLog:
    rid: str
    epoch: int
    seed: int
    start: int
    n: int
    floor: int
    dec_floor: int
    cache_start: int
    fresh: bool
    is_prefill: bool
    sample: bool
    out_index: int | None      # index of the output token sampled (position - len(prompt))
    token: int | None          # the token sampled
    placeholder: bool
    banned: list[int]
    prompt_len: int
    plp: bool


@dataclasses.dataclass
class _Slot:
    owner: tuple[str, int]     # (request id, epoch) -- a test oracle, the device has no ids
    floor: int
    toks: list[int]            # tokens of positions [floor, floor + len(toks))

    @property
    def end(self) -> int:
        return self.floor + len(self.toks)


@dataclasses.dataclass
class FakeResult:
    token_ids: np.ndarray
    logprob: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    prompt_target_lp: np.ndarray | None
    prompt_top_ids: np.ndarray | None
    prompt_top_lp: np.ndarray | None
    token_offsets: list[int]


class FakeHandle:
    def __init__(self, runner, sched, result, t_dispatch, bucket):
        self.runner, self.sched, self._result = runner, sched, result
        self.t_dispatch, self.t_done, self.bucket_tokens = t_dispatch, None, bucket
        self.inputs_time = self.call_time = 0.0  # the runner's host-time split (StepHandle)

    def fetch(self) -> FakeResult:
        r = self.runner
        assert self.t_done is None, "step fetched twice"
        assert self.sched.step_id == r.next_fetch, "steps fetched out of dispatch order"
        r.next_fetch += 1
        self.t_done = time.perf_counter()
        return self._result


class FakeRunner:
    """The device, without JAX (see the module docstring)."""

    def __init__(self, ec: EngineConfig):
        self.ec, self.bt = ec, ec.block_tokens
        self.store: list[list[tuple[int, int] | None]] = [[None] * self.bt for _ in range(ec.num_blocks)]
        self.slots: dict[int, _Slot] = {}
        self.prev_sampled: list[int | None] | None = None
        self.last_step = -1
        self.next_fetch = 0
        self.log: list[list[RowLog]] = []
        self.scheduler: Scheduler | None = None
        self.history_tokens = 3  # as v41-tiny's Engram (max_ngram_size 4): rows carry that look-back

    def attach(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def _entry(self, blocks, p):
        return self.store[blocks[p // self.bt]][p % self.bt]

    def execute(self, sched) -> FakeHandle:
        t0 = time.perf_counter()
        ec, bt, sch = self.ec, self.bt, self.scheduler
        R, N = ec.max_num_seqs, ec.max_logprobs
        rows = sched.rows
        assert rows, "empty step dispatched"
        assert len(rows) <= R, f"{len(rows)} rows > max_num_seqs"
        assert sched.num_tokens <= ec.max_num_batched_tokens
        assert sched.step_id == self.last_step + 1, "step ids not consecutive"
        self.last_step = sched.step_id
        T = sched.num_tokens
        plp = sched.wants_prompt_logprobs
        tgt_lp = np.zeros(T, np.float32) if plp else None
        ptop_ids = np.zeros((T, N), np.int32) if plp else None
        ptop_lp = np.zeros((T, N), np.float32) if plp else None
        sampled: list[int | None] = [None] * R
        tok_out = np.full(R, -3, np.int32)
        lp_out = np.zeros(R, np.float32)
        top_ids = np.zeros((R, N), np.int32)
        top_lp = np.zeros((R, N), np.float32)
        seen_rids, seen_slots, logs = set(), set(), []
        holders: dict[int, list[str]] = {}
        for r in sch.running:
            for b in r.blocks:
                holders.setdefault(b, []).append(r.request_id)
        assert all(len(h) == sch.pool.ref_count(b) for b, h in holders.items())
        fresh_rows = {r.request_id: (i, r.cache_start) for i, r in enumerate(rows) if r.start == r.floor}
        off = 0
        for i, row in enumerate(rows):
            rid = row.request_id
            req = sch.requests[rid]  # the oracle's view; the row itself is plain data
            assert row.epoch == req.epoch and row.seed == req.seed and row.params is req.params
            assert rid not in seen_rids, f"{rid} has two rows in step {sched.step_id}"
            assert row.slot not in seen_slots, f"slot {row.slot} used twice in one step"
            seen_rids.add(rid)
            seen_slots.add(row.slot)
            assert sch.slots.slot_of(rid) == row.slot
            assert row.blocks == sch.pool.blocks_of(rid), f"{rid}: row blocks differ from its table"
            # --- tokens, placeholder resolved from the previous step's samples (on device)
            toks = list(row.token_ids)
            assert toks and all(t >= 0 for t in toks[:-1])
            if row.prev_row >= 0:
                assert toks[-1] == -1, "placeholder row whose last token is not -1"
                assert self.prev_sampled is not None and 0 <= row.prev_row < R
                t = self.prev_sampled[row.prev_row]
                assert t is not None, f"{rid}: placeholder names row {row.prev_row} which did not sample"
                toks[-1] = t
            else:
                assert toks[-1] >= 0, "-1 token without a previous-step row"
            n, start = len(toks), row.start
            end = start + n
            assert end <= sch.max_model_len
            assert row.floor % bt == 0 and row.cache_start % bt == 0, (row.floor, row.cache_start)
            assert row.floor <= row.cache_start
            assert len(row.blocks) >= -(-end // bt), f"{rid}: blocks do not cover [0, {end})"
            owner = (rid, row.epoch)
            fresh = start == row.floor
            if fresh:
                slot = _Slot(owner, row.floor, [])
                self.slots[row.slot] = slot
                # prefix hit: the shared blocks must hold exactly this request's tokens
                for p in range(row.cache_start):
                    e = self._entry(row.blocks, p)
                    assert e is not None and e[0] == req.token_at(p), \
                        f"{rid}: prefix hit block {row.blocks[p // bt]} holds other tokens at {p}"
            else:
                slot = self.slots.get(row.slot)
                assert slot is not None and slot.owner == owner, \
                    f"{rid}: slot {row.slot} holds {slot and slot.owner}, not this request's state"
                assert slot.floor == row.floor and slot.end == start, \
                    f"{rid}: row starts at {start} (floor {row.floor}) but slot state is " \
                    f"[{slot.floor}, {slot.end})"
            # --- history [0, start) from the cache
            fp = _FP0
            for p in range(start):
                e = self._entry(row.blocks, p)
                assert e is not None, f"{rid}: position {p} < start {start} never written"
                tok, efp = e
                fp = _fp(fp, tok)
                assert efp == fp, f"{rid}: block entry at {p} belongs to another history"
                known = req.token_at(p)
                assert known is None or known == tok, f"{rid}: cache has {tok} at {p}, host {known}"
                if p >= row.floor:
                    assert slot.toks[p - row.floor] == tok
            # --- the Engram look-back window the row carries
            known = n - (1 if row.prev_row >= 0 else 0)
            w0 = max(start - self.history_tokens, 0)
            assert row.history == req.known_tokens(w0, start + known), f"{rid}: wrong history window"
            # --- the row's positions
            n_prompt = len(req.prompt_token_ids)
            if row.prompt_logprobs:
                assert row.prompt_targets == req.prompt_token_ids[start + 1:min(end + 1, n_prompt)]
            for j, tok in enumerate(toks):
                p = start + j
                fp = _fp(fp, tok)
                if p < row.cache_start:  # replay over shared blocks: read-only, must agree
                    assert self._entry(row.blocks, p) == (tok, fp), f"{rid}: replay differs at {p}"
                else:
                    b = row.blocks[p // bt]
                    # Only the owner writes a block. Another holder is legal only if it took the
                    # block as a prefix hit in this same step, in a later row, at this position:
                    # the device writes a layer's entries before any row reads them.
                    for other in holders.get(b, ()):
                        if other == rid:
                            continue
                        later = fresh_rows.get(other)
                        assert later is not None and later[0] > i and p < later[1], \
                            f"{rid}: writes position {p} into block {b}, shared with {other}"
                    self.store[b][p % bt] = (tok, fp)
                slot.toks.append(tok)
                if plp and row.prompt_logprobs and p + 1 < n_prompt:
                    tgt = row.prompt_targets[j]
                    tgt_lp[off + j] = -(((fp ^ tgt) % 997) + 1) / 100.0
                    ptop_ids[off + j] = [(fp + k) % V for k in range(N)]
                    ptop_lp[off + j] = [-0.1 * (k + 1) - (fp % 7) / 10 for k in range(N)]
            out_index, token = None, None
            if row.sample:
                out_index = end - n_prompt
                assert end == req.num_tokens_planned - 1, f"{rid}: samples {end}, not the sequence end"
                assert out_index < req.params.max_tokens, f"{rid}: sample {out_index} >= max_tokens"
                assert end < sch.max_model_len, f"{rid}: sample beyond max_model_len"
                assert end - 1 >= row.dec_floor, f"{rid}: sampled position below the decoder floor"
                token = _draw(row.seed, fp)
                while token in row.banned:
                    token = (token + 1) % V
                sampled[i] = token
                tok_out[i] = token
                lp_out[i] = -((fp % 13) + 1) / 10.0
                top_ids[i] = [token] + [(token + k) % V for k in range(1, N)]
                top_lp[i] = [lp_out[i] - 0.5 * k for k in range(N)]
            else:
                assert end < req.num_tokens_planned, f"{rid}: non-sampling row reaches the end"
                # a chunk stopping short of the sequence end was cut by the token budget: it is
                # the step's last row and takes all the budget left
                assert i == len(rows) - 1 and T == ec.max_num_batched_tokens, \
                    f"{rid}: chunk of {n} cut short with budget left"
            logs.append(RowLog(rid, row.epoch, row.seed, start, n, row.floor, row.dec_floor, row.cache_start,
                               fresh, row.is_prefill, row.sample, out_index, token, row.prev_row >= 0,
                               list(row.banned), n_prompt, row.prompt_logprobs))
            off += n
        self.prev_sampled = sampled
        self.log.append(logs)
        offsets = [int(o) for o in np.cumsum([0] + [r.num_tokens for r in rows])[:-1]]
        bucket = next(b for b in ec.token_buckets if b >= T)
        res = FakeResult(tok_out, lp_out, top_ids, top_lp, tgt_lp, ptop_ids, ptop_lp, offsets)
        return FakeHandle(self, sched, res, t0, bucket)

    # ---- views of the log
    def rows(self):
        return [r for step in self.log for r in step]


class SchedRecorder:
    """Wraps ``Scheduler.schedule`` to see the queues just before and after each plan."""

    def __init__(self, sch: Scheduler):
        self.sch, self.log = sch, []
        orig = sch.schedule

        def wrapped():
            mml = sch.max_model_len
            before = dict(
                running=[r.request_id for r in sch.running],
                waiting=[r.request_id for r in sch.waiting],
                decode_ready={r.request_id for r in sch.running
                              if r.num_computed == r.num_tokens_planned - 1
                              and r.num_outputs_planned < r.params.max_tokens and r.num_tokens_planned < mml})
            out = orig()
            after = dict(running=[r.request_id for r in sch.running], waiting=[r.request_id for r in sch.waiting])
            self.log.append((before, out, after))
            return out

        sch.schedule = wrapped


def make_engine(ec, eos=EOS, record=False):
    runner = FakeRunner(ec)
    eng = LLMEngine(runner, ec, tokenizer=None, eos_token_id=eos)
    runner.attach(eng.scheduler)
    rec = SchedRecorder(eng.scheduler) if record else None
    return eng, runner, rec


def drive(eng, max_steps=4000, on_step=None) -> dict:
    """Run to completion, checking the pools after every round."""
    outs, steps = {}, 0
    sch = eng.scheduler
    while eng.has_unfinished_requests():
        for o in eng.step():
            assert o.request_id not in outs, f"{o.request_id} returned twice"
            outs[o.request_id] = o
        steps += 1
        assert steps < max_steps, "engine does not finish"
        sch.pool.check_invariants()
        assert sch.pool.num_requests == len(sch.running) == sch.slots.num_used
        if on_step is not None:
            on_step(steps)
    assert sch.pool.num_used == 0 and sch.slots.num_used == 0 and not sch.requests
    return outs


def run(ec, reqs, eos=EOS, record=False):
    eng, runner, rec = make_engine(ec, eos, record)
    for rid, prompt, p in reqs:
        eng.add_request(rid, prompt, p)
    outs = drive(eng)
    assert set(outs) == {r[0] for r in reqs}, "a request was lost"
    return outs, eng, runner, rec


def tokens_of(outs) -> dict:
    return {rid: [(c.index, tuple(c.token_ids), c.finish_reason, c.stop_reason) for c in o.outputs]
            for rid, o in outs.items()}


def mixed_workload(seed=1, n=16, lengths=None):
    rng = np.random.default_rng(seed)
    lengths = lengths or [1, 3, 200, 65, 17, 300, 64, 130, 9, 250, 40, 100, 5, 77, 180, 33][:n]
    reqs = []
    for i, L in enumerate(lengths):
        kw = dict(seed=int(rng.integers(0, 2**40)), max_tokens=int(rng.integers(1, 40)))
        if i % 4 == 1:
            kw["ignore_eos"] = True
        if i % 5 == 2:
            kw["stop_token_ids"] = [int(rng.integers(1, V))]
        if i % 6 == 3:
            kw["min_tokens"] = min(4, kw["max_tokens"])
        reqs.append((f"r{i}", rand_prompt(rng, L), params(**kw)))
    return reqs


# =========================================================================== 0. no JAX


def test_no_jax_imported():
    """The host side (scheduler, engine loop, config, sampling params) runs without JAX: checked
    in a fresh interpreter, since other test modules of the session import JAX."""
    import subprocess

    code = ("import sys\n"
            "import deepinfer_jax.host_scheduler.scheduler, deepinfer_jax.engine.llm_engine\n"
            "import deepinfer_jax.engine_config, deepinfer_jax.sampling.params, deepinfer_jax.config\n"
            "bad = sorted(m for m in sys.modules if m == 'jax' or m.startswith(('jax.', 'jaxlib')))\n"
            "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# =========================================================================== 1. batching


@pytest.fixture(scope="module")
def alone_outputs():
    ec = make_ec(async_scheduling=False)
    res = {}
    for rid, prompt, p in mixed_workload():
        outs, *_ = run(ec, [(rid, prompt, p)])
        res.update(tokens_of(outs))
    return res


@pytest.mark.parametrize("async_sched", [True, False], ids=["async", "sync"])
def test_batched_equals_one_at_a_time(async_sched, alone_outputs):
    ec = make_ec(async_scheduling=async_sched)
    reqs = mixed_workload()
    assert max(len(r[1]) for r in reqs) > ec.max_num_batched_tokens  # some prompts are chunked
    outs, eng, runner, _ = run(ec, reqs)
    assert tokens_of(outs) == alone_outputs
    rows = runner.rows()
    # the run really batched, chunked, queued, and (async) used placeholders
    assert max(len(step) for step in runner.log) >= 4
    assert any(r.is_prefill and not r.fresh for r in rows), "no chunked prefill continued"
    assert any(r.is_prefill and not r.sample for r in rows)
    assert any(r.placeholder for r in rows) == async_sched
    for rid, _, p in reqs:
        (c,) = outs[rid].outputs
        assert 1 <= len(c.token_ids) <= p.max_tokens and c.finish_reason in ("stop", "length")


# =========================================================================== 2. budget, FCFS


def test_budget_row_cap_decode_first_and_fcfs():
    ec = make_ec(max_num_seqs=4, max_num_batched_tokens=32)
    rng = np.random.default_rng(2)
    first = [(f"a{i}", rand_prompt(rng, int(rng.integers(2, 90))),
              params(seed=i, max_tokens=int(rng.integers(3, 25)), ignore_eos=True)) for i in range(6)]
    later = [(f"b{i}", rand_prompt(rng, int(rng.integers(2, 90))),
              params(seed=100 + i, max_tokens=int(rng.integers(3, 25)), ignore_eos=True)) for i in range(6)]
    eng, runner, rec = make_engine(ec, record=True)
    for r in first:
        eng.add_request(*r)

    def add_later(step):
        if step == 5:
            for r in later:
                eng.add_request(*r)

    outs = drive(eng, on_step=add_later)
    assert set(outs) == {r[0] for r in first + later}
    admitted_order = []
    saw_decode_with_admission = False
    for before, out, after in rec.log:
        assert out.num_tokens <= ec.max_num_batched_tokens
        assert len(out.rows) <= ec.max_num_seqs
        rids = [r.request_id for r in out.rows]
        pre = [r for r in rids if r in before["running"]]
        new = [r for r in rids if r not in before["running"]]
        # rows of running requests first, oldest first; then admissions FCFS from the queue head
        assert rids == pre + new
        assert pre == [r for r in before["running"] if r in pre]
        assert new == before["waiting"][:len(new)]
        if new:
            # a new prefill is admitted only after every decode-ready request got its token
            missing = before["decode_ready"] - set(pre)
            assert not missing, f"step {out.step_id}: admitted {new} while {missing} waited to decode"
            saw_decode_with_admission |= bool(before["decode_ready"])
        admitted_order += new
    assert saw_decode_with_admission
    assert admitted_order == [r[0] for r in first + later]  # FCFS, no preemption here
    for rid, prompt, p in first + later:
        assert len(outs[rid].outputs[0].token_ids) == p.max_tokens


# =========================================================================== 3. preemption


def preemption_workload(seed=3):
    rng = np.random.default_rng(seed)
    return [(f"p{i}", rand_prompt(rng, int(rng.integers(30, 120))),
             params(seed=7 * i + 1, max_tokens=int(rng.integers(30, 70)), ignore_eos=True)) for i in range(10)]


@pytest.mark.parametrize("async_sched,caching", [(True, True), (False, False), (True, False)])
def test_preemption_recomputes_exactly(async_sched, caching):
    kw = dict(max_model_len=256, async_scheduling=async_sched, enable_prefix_caching=caching)
    reqs = preemption_workload()
    ref, *_ = run(make_ec(**kw), reqs)
    outs, eng, runner, rec = run(make_ec(num_blocks=20, **kw), reqs, record=True)
    assert eng.scheduler.num_preemptions > 0
    assert tokens_of(outs) == tokens_of(ref)
    for rid, prompt, p in reqs:
        (c,) = outs[rid].outputs
        assert len(c.token_ids) == p.max_tokens and c.finish_reason == "length"
    assert sum(o.outputs[0].metrics.num_preemptions for o in outs.values()) == eng.scheduler.num_preemptions
    n_checked = 0
    for before, out, after in rec.log:
        if not out.preempted:
            continue
        k = len(out.preempted)
        # the newest running requests are preempted, newest first
        assert out.preempted == before["running"][::-1][:k]
        # and go to the front of the queue (the last one preempted first), unless re-admitted
        front = [r for r in reversed(out.preempted) if r in after["waiting"]]
        assert after["waiting"][:len(front)] == front
        assert all(r in after["running"] for r in out.preempted if r not in front)
        n_checked += 1
    assert n_checked > 0
    # a preempted request restarts from its floor, in a new epoch, with prompt + outputs so far
    # as its "prompt"
    first_epoch = {}
    for r in runner.rows():
        first_epoch.setdefault(r.rid, r.epoch)
    assert any(r.fresh and r.epoch != first_epoch[r.rid] and r.start + r.n > r.prompt_len for r in runner.rows())


def test_preemption_keeps_prompt_logprobs():
    """A request preempted in the middle of its prompt still returns every prompt logprob."""
    rng = np.random.default_rng(33)
    kw = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32)
    reqs = [("old", rand_prompt(rng, 100), params(seed=1, max_tokens=100, ignore_eos=True)),
            ("plp", rand_prompt(rng, 150), params(seed=2, max_tokens=20, ignore_eos=True, prompt_logprobs=2))]
    for async_sched in (True, False):
        ref, *_ = run(make_ec(async_scheduling=async_sched, **kw), reqs)
        outs, eng, runner, _ = run(make_ec(num_blocks=16, async_scheduling=async_sched, **kw), reqs)
        assert outs["plp"].outputs[0].metrics.num_preemptions > 0
        got, want = outs["plp"].prompt_logprobs, ref["plp"].prompt_logprobs
        assert got[0] is None and all(d is not None for d in want[1:])
        missing = [i for i, d in enumerate(got) if i and d is None]
        assert not missing, f"prompt logprobs lost at {len(missing)} positions from {missing[0]}"
        assert got == want
        assert tokens_of(outs) == tokens_of(ref)


# =========================================================================== 4. prefix caching


def prefix_workload(seed=4, n=8, prefix_len=100):
    rng = np.random.default_rng(seed)
    prefix = rand_prompt(rng, prefix_len)
    reqs = [(f"s{i}", prefix + rand_prompt(rng, int(rng.integers(5, 40))),
             params(seed=1000 + i, max_tokens=int(rng.integers(5, 30)))) for i in range(n)]
    return reqs


@pytest.mark.parametrize("mode,replay", [("exact", None), ("bounded", None), ("bounded", 0), ("bounded", 20)])
def test_prefix_caching_hits_and_same_outputs(mode, replay):
    reqs = prefix_workload()
    # second wave: the same prompts again after the first wave finished (hits on freed blocks)
    reqs2 = [(rid + "x", prompt, p) for rid, prompt, p in reqs]
    # bounded's default tail is yoco_keep_tokens
    kw = dict(max_num_seqs=4, prefix_replay=mode, prefix_replay_tokens=replay, yoco_keep_tokens=24)
    ec_on = make_ec(**kw)
    R = ec_on.prefix_replay_tokens
    assert R == {"exact": 5 * 7 + 8, "bounded": 24 if replay is None else replay}[mode]

    def two_waves(ec):
        eng, runner, _ = make_engine(ec)
        for r in reqs:
            eng.add_request(*r)
        outs = drive(eng)
        for r in reqs2:
            eng.add_request(*r)
        outs.update(drive(eng))
        return outs, eng, runner, eng.stats.summary()

    outs, eng, runner, stats_on = two_waves(ec_on)
    ref, eng_off, _, stats_off = two_waves(make_ec(enable_prefix_caching=False, **kw))
    assert tokens_of(outs) == tokens_of(ref)
    # third turn (multi-turn chat): prompt = earlier prompt + its answer + more. Every full block
    # the earlier request computed with known tokens was cached, so the hit is exact.
    rng = np.random.default_rng(40)
    computed = {}
    for r in runner.rows():
        computed[r.rid] = max(computed.get(r.rid, 0), r.start + r.n)
    follow = []
    for rid, prompt, p in reqs[:4]:
        prev = prompt + outs[rid].outputs[0].token_ids
        follow.append((rid + "t", prev + rand_prompt(rng, 20), params(seed=1, max_tokens=3)))
    eng.scheduler.pool.reset_stats()
    for r in follow:
        eng.add_request(*r)
    more = drive(eng)
    for (rid, prompt, _), (rid2, prompt2, _) in zip(reqs[:4], follow):
        n_prev = len(prompt) + len(outs[rid].outputs[0].token_ids)
        hit = min(computed[rid], n_prev) // BT * BT
        want = max(0, hit - R) // BT * BT  # cached minus replayed: the tokens not recomputed
        assert more[rid2].num_cached_tokens == want, (rid, more[rid2].num_cached_tokens, want)
    assert eng.scheduler.pool.hit_rate > 0 and eng_off.scheduler.pool.hit_rate == 0
    assert any(o.num_cached_tokens > 0 for rid, o in outs.items() if not rid.endswith("x"))
    assert all(o.num_cached_tokens > 0 for rid, o in outs.items() if rid.endswith("x"))
    assert all(o.num_cached_tokens == 0 for o in ref.values())
    first_admission = {}
    hits = 0
    for r in runner.rows():
        if r.fresh:
            first_admission.setdefault(r.rid, r)
            if r.cache_start:
                hits += 1
                assert r.start == r.floor == max(0, r.cache_start - R) // BT * BT
                if R == 0:
                    assert r.floor == r.cache_start
    assert hits > 0
    assert all(first_admission[rid].cache_start > 0 for rid in outs if rid.endswith("x"))
    saved = 0
    for rid, o in outs.items():
        # tokens served and not replayed (0 when the replay starts at 0)
        assert o.num_cached_tokens == first_admission[rid].start
        assert o.num_cached_tokens % BT == 0 and o.num_cached_tokens <= len(o.prompt_token_ids) - 1
        saved += o.num_cached_tokens
    # the device computed exactly the prompt positions the cache did not save (no preemption here)
    n_prompt = sum(len(p) for _, p, _ in reqs + reqs2)
    prompt_positions = sum(max(0, min(r.start + r.n, r.prompt_len) - r.start) for r in runner.rows()
                           if not r.rid.endswith("t"))
    assert stats_on["preemptions"] == 0 and stats_on["cache_hit_tokens"] == saved
    assert prompt_positions == n_prompt - saved and stats_off["cache_hit_tokens"] == 0
    assert saved > 0


def test_prefix_cache_never_matches_other_tokens():
    """Prompts sharing only part of a block, or nothing, get no hit beyond the common full blocks."""
    rng = np.random.default_rng(44)
    base = rand_prompt(rng, 70)
    other = list(base)
    other[40] = other[40] % (V - 1) + 1  # differs inside block 2
    reqs = [("base", base, params(seed=1, max_tokens=3)),
            ("other", other, params(seed=1, max_tokens=3)),
            ("plp", list(base), params(seed=1, max_tokens=3, prompt_logprobs=1))]
    ec = make_ec(max_num_seqs=1, prefix_replay_tokens=0)  # one at a time: every earlier prompt is cached
    outs, eng, runner, _ = run(ec, reqs)
    assert outs["base"].num_cached_tokens == 0
    assert outs["other"].num_cached_tokens == 2 * BT
    assert outs["plp"].num_cached_tokens == 0  # prompt logprobs need every position computed
    assert outs["plp"].outputs[0].token_ids == outs["base"].outputs[0].token_ids
    assert hash_request_blocks(base, BT)[:2] == hash_request_blocks(other, BT)[:2]


# =========================================================================== 5. async bookkeeping


def stop_workload(seed=5, n=24):
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(n):
        kw = dict(seed=int(rng.integers(0, 2**40)), max_tokens=int(rng.integers(1, 60)))
        if i % 3 == 0:
            kw["stop_token_ids"] = [int(rng.integers(1, V)), EOS]
        if i % 4 == 1:
            kw["min_tokens"] = min(6, kw["max_tokens"])
        if i % 8 == 5:
            kw["ignore_eos"] = True
        reqs.append((f"q{i}", rand_prompt(rng, int(rng.integers(1, 80))), params(**kw)))
    # runs into max_model_len before max_tokens
    reqs.append(("long", rand_prompt(rng, 250), params(seed=9, max_tokens=100, ignore_eos=True)))
    return reqs


def test_async_stop_drops_late_samples_and_respects_limits():
    reqs = stop_workload()
    by_id = {r[0]: r for r in reqs}
    results = {}
    for async_sched in (True, False):
        ec = make_ec(max_model_len=256, async_scheduling=async_sched)
        outs, eng, runner, _ = run(ec, reqs)
        results[async_sched] = (outs, runner)
        for rid, o in outs.items():
            (c,) = o.outputs
            p = by_id[rid][2]
            toks = c.token_ids
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else {EOS})
            assert 1 <= len(toks) <= p.max_tokens
            assert len(o.prompt_token_ids) + len(toks) <= ec.max_model_len
            assert not stops & set(toks[:-1]), f"{rid} went on past a stop token"
            assert not stops & set(toks[:p.min_tokens]), f"{rid}: stop token before min_tokens"
            if c.finish_reason == "stop":
                assert toks[-1] in stops
                eos_stop = toks[-1] == EOS and not p.ignore_eos  # EOS is checked first (as vLLM)
                assert c.stop_reason == (None if eos_stop else toks[-1])
            else:
                assert c.finish_reason == "length"
                assert len(toks) == p.max_tokens or len(o.prompt_token_ids) + len(toks) == ec.max_model_len
        assert outs["long"].outputs[0].finish_reason == "length"
        assert len(outs["long"].outputs[0].token_ids) == 256 - 250
        # min_tokens: EOS (unless ignore_eos) and stop ids banned exactly for the first min_tokens samples
        for r in runner.rows():
            if not r.sample:
                continue
            p = by_id[r.rid][2]
            want = set(p.stop_token_ids) | (set() if p.ignore_eos else {EOS})
            assert set(r.banned) == (want if r.out_index < p.min_tokens else set()), (r.rid, r.out_index)
    (a_outs, a_runner), (s_outs, _) = results[True], results[False]
    assert tokens_of(a_outs) == tokens_of(s_outs)
    assert sum(o.outputs[0].finish_reason == "stop" for o in a_outs.values()) >= 5
    # async: the step after a stop token was already in flight; its sample was dropped
    late = [r for r in a_runner.rows()
            if r.sample and r.out_index >= len(a_outs[r.rid].outputs[0].token_ids)]
    assert late, "no request stopped while a later step for it was in flight"
    assert all(a_outs[r.rid].outputs[0].finish_reason == "stop" for r in late)
    assert all(r.placeholder for r in late)


@pytest.mark.parametrize("async_sched", [True, False], ids=["async", "sync"])
def test_steady_decode_one_step_per_token(async_sched):
    """Alone, a request decodes one token every step: async chains placeholders (two samples in
    flight) without ever skipping a round."""
    rng = np.random.default_rng(51)
    M = 25
    outs, eng, runner, _ = run(make_ec(async_scheduling=async_sched),
                               [("d", rand_prompt(rng, 40), params(seed=3, max_tokens=M, ignore_eos=True))])
    assert len(outs["d"].outputs[0].token_ids) == M
    assert len(runner.log) == M  # prefill + M - 1 decode steps, no empty or repeated rounds
    dec = [r for r in runner.rows() if not r.is_prefill]
    assert [r.start for r in dec] == list(range(40, 40 + M - 1))
    assert all(r.n == 1 and r.sample for r in dec)
    assert all(r.placeholder for r in dec) == async_sched and any(r.placeholder for r in dec) == async_sched
    assert len(eng.stats.steps) == M


def test_min_tokens_with_ignore_eos_bans_only_stop_ids():
    """As vLLM's min-tokens processor: with ``ignore_eos`` EOS is an ordinary token, even early."""
    rng = np.random.default_rng(55)
    reqs = [(f"m{i}", rand_prompt(rng, 20), params(seed=i, max_tokens=8, min_tokens=8, ignore_eos=True,
                                                    stop_token_ids=[7])) for i in range(40)]
    outs, eng, runner, _ = run(make_ec(), reqs)
    assert all(set(r.banned) == {7} for r in runner.rows() if r.sample)
    assert any(EOS in o.outputs[0].token_ids for o in outs.values())


# =========================================================================== 6. YOCO dec_floor


@pytest.mark.parametrize("mode", ["compact", "mask", "off"])
def test_yoco_dec_floor(mode):
    K = 24
    reqs = prefix_workload(seed=6, n=6, prefix_len=80)
    rng = np.random.default_rng(66)
    reqs += [("short", rand_prompt(rng, 10), params(seed=1, max_tokens=5)),
             ("plp", rand_prompt(rng, 120), params(seed=2, max_tokens=5, prompt_logprobs=1))]
    ec = make_ec(max_num_seqs=3, yoco_truncation=mode, yoco_keep_tokens=K)
    outs, eng, runner, _ = run(ec, reqs)
    plp = {rid for rid, _, p in reqs if p.prompt_logprobs is not None}
    saw_floor_raise = saw_hit = False
    for r in runner.rows():
        if mode == "off" or r.rid in plp:
            assert r.dec_floor == r.floor
        else:
            assert r.dec_floor == max(r.floor, r.prompt_len - K), r
            saw_floor_raise |= r.dec_floor > r.floor
        saw_hit |= r.floor > 0
    assert saw_hit and (saw_floor_raise or mode == "off")
    off, *_ = run(make_ec(max_num_seqs=3, yoco_truncation="off", yoco_keep_tokens=K), reqs)
    assert tokens_of(outs) == tokens_of(off)
    assert all(o.prompt_logprobs is None for rid, o in outs.items() if rid not in plp)
    assert all(d is not None for d in outs["plp"].prompt_logprobs[1:])


def test_yoco_dec_floor_set_on_add():
    ec = make_ec(yoco_keep_tokens=30)
    sch = Scheduler(ec)
    a = Request("a", list(range(1, 101)), params(), seed=0)
    b = Request("b", list(range(1, 11)), params(), seed=0)
    c = Request("c", list(range(1, 101)), params(prompt_logprobs=0), seed=0)
    for r in (a, b, c):
        sch.add_request(r)
    assert (a.dec_floor, b.dec_floor, c.dec_floor) == (70, 0, 0)
    sch_off = Scheduler(make_ec(yoco_truncation="off", yoco_keep_tokens=30))
    d = Request("d", list(range(1, 101)), params(), seed=0)
    sch_off.add_request(d)
    assert d.dec_floor == 0


# =========================================================================== 7. config errors


@pytest.mark.parametrize("kw,field,value", [
    (dict(yoco_keep_tokens=10), "yoco_keep_tokens", "10"),
    (dict(yoco_truncation="fast"), "yoco_truncation", "'fast'"),
    (dict(max_num_batched_tokens=64, token_buckets=(16, 32)), "token_buckets", "(16, 32)"),
    (dict(num_blocks=3), "num_blocks", "3"),
    (dict(max_num_seqs=0), "max_num_seqs", "0"),
    (dict(max_num_seqs=32, max_num_batched_tokens=16), "max_num_batched_tokens", "16"),
    (dict(prefix_replay_tokens=-1), "prefix_replay_tokens", "-1"),
    (dict(prefix_replay="approx"), "prefix_replay", "'approx'"),
    (dict(prefix_replay="exact", prefix_replay_tokens=42), "prefix_replay_tokens", "42"),
    (dict(max_model_len=100000), "max_model_len", "100000"),
])
def test_engine_config_errors_name_field_and_value(kw, field, value):
    with pytest.raises(ValueError) as ei:
        EngineConfig(**kw).resolve(MODEL_CFG)
    msg = str(ei.value)
    assert f"EngineConfig.{field}={value}" in msg, msg


def test_replay_that_never_saves_work_is_a_start_up_error():
    """A replay tail that takes every possible hit back to position 0 makes prefix caching pure
    overhead (hits reported, nothing saved): refused at start-up, naming the fields and values."""
    # max_model_len 64, blocks of 16: the longest hit is 48 tokens (the last token is never a hit)
    with pytest.raises(ValueError) as ei:
        make_ec(max_model_len=64, prefix_replay_tokens=40)
    msg = str(ei.value)
    assert "EngineConfig.prefix_replay='bounded' with prefix_replay_tokens=40" in msg and "max_model_len=64" in msg
    assert make_ec(max_model_len=64, prefix_replay_tokens=32).prefix_replay_tokens == 32  # hits of 48 save 16
    assert make_ec(max_model_len=64, prefix_replay_tokens=40, enable_prefix_caching=False)
    # the same with only the defaults (tail = yoco_keep_tokens 140): no error, prefix caching off
    ec = make_ec(max_model_len=64)
    assert ec.enable_prefix_caching is False and ec.resolve(MODEL_CFG) == ec
    # V4.1-Flash defaults: the exact replay (39*127+128) exceeds max_model_len 4096; bounded is the default
    flash = preset("v41-flash")
    with pytest.raises(ValueError, match=r"prefix_replay='exact' with prefix_replay_tokens=5081 .*max_model_len=4096"):
        EngineConfig(prefix_replay="exact").resolve(flash)
    ec = EngineConfig().resolve(flash)
    assert (ec.max_model_len, ec.prefix_replay, ec.prefix_replay_tokens) == (4096, "bounded", 140)


def test_engine_config_unknown_field_and_defaults():
    with pytest.raises(ValueError, match=r"max_num_seq\b.*known"):
        EngineConfig.from_kwargs(max_num_seq=4)
    ec = EngineConfig.from_kwargs(yoco_truncation="off", yoco_keep_tokens=1).resolve(MODEL_CFG)
    assert ec.yoco_keep_tokens == 1  # not checked when truncation is off
    ec = EngineConfig(block_tokens=BT, max_num_batched_tokens=100).resolve(MODEL_CFG)
    assert ec.max_model_len == 512 and ec.num_blocks == ec.max_num_seqs * 512 // BT
    assert ec.prefix_replay == "bounded" and ec.prefix_replay_tokens == ec.yoco_keep_tokens == 140
    exact = EngineConfig(prefix_replay="exact").resolve(MODEL_CFG)
    assert exact.prefix_replay_tokens == (MODEL_CFG.num_hidden_layers - 1) * (MODEL_CFG.sliding_window - 1) \
        + MODEL_CFG.sliding_window
    assert exact.resolve(MODEL_CFG) == exact
    assert ec.token_buckets == (16, 32, 64, 100)


# =========================================================================== 8. n > 1


def test_n_samples_distinct_seeds_in_index_order():
    rng = np.random.default_rng(8)
    prompt = rand_prompt(rng, 70)
    n = 4
    outs, eng, runner, _ = run(make_ec(), [("g", prompt, params(n=n, seed=1234, max_tokens=12, ignore_eos=True)),
                                           ("h", rand_prompt(rng, 30), params(n=3, max_tokens=5))])
    g = outs["g"]
    assert [c.index for c in g.outputs] == list(range(n))
    assert g.prompt_token_ids == prompt and g.finished
    seeds = {r.rid: r.seed for r in runner.rows()}
    assert [seeds[f"g#{i}"] for i in range(n)] == [child_seed(1234, i) for i in range(n)]
    assert len({seeds[f"h#{i}"] for i in range(3)}) == 3  # drawn seed, children still distinct
    assert len({tuple(c.token_ids) for c in g.outputs}) == n
    # each completion is exactly what its child seed gives alone
    for i in range(n):
        alone, *_ = run(make_ec(), [("x", prompt, params(seed=child_seed(1234, i), max_tokens=12, ignore_eos=True))])
        assert g.outputs[i].token_ids == alone["x"].outputs[0].token_ids
    assert [c.index for c in outs["h"].outputs] == [0, 1, 2]


def test_round_that_plans_nothing_while_results_are_in_flight():
    """Every running request has its last sample in flight and the queue waits for a slot: that
    round plans no step, but processing the in-flight results frees the slots (no stall error)."""
    rng = np.random.default_rng(9)
    reqs = [(f"t{i}", rand_prompt(rng, 5), params(seed=i, max_tokens=1)) for i in range(12)]
    for async_sched in (True, False):
        outs, eng, runner, _ = run(make_ec(max_num_seqs=4, async_scheduling=async_sched), reqs)
        assert all(len(o.outputs[0].token_ids) == 1 for o in outs.values())
    n = 4  # n == max_num_seqs: all samples finish in the same round, another prompt waits
    outs, *_ = run(make_ec(max_num_seqs=n), [("a", rand_prompt(rng, 20), params(n=n, seed=1, max_tokens=6, ignore_eos=True)),
                                            ("b", rand_prompt(rng, 20), params(seed=2, max_tokens=3))])
    assert [len(c.token_ids) for c in outs["a"].outputs] == [6] * n


@pytest.mark.parametrize("async_sched", [True, False])
def test_abort_frees_resources_and_keeps_others(async_sched):
    ec = make_ec(async_scheduling=async_sched)
    rng = np.random.default_rng(9)
    reqs = [(f"a{i}", rand_prompt(rng, 30 + 7 * i), params(max_tokens=12, seed=i)) for i in range(4)]
    ref, *_ = run(ec, reqs)
    eng, _, _ = make_engine(ec)
    for rid, prompt, p in reqs:
        eng.add_request(rid, prompt, p)
    for _ in range(4):
        eng.step()
    out = eng.abort_request("a1")
    assert out.outputs[0].finish_reason == "abort" and len(out.outputs[0].token_ids) < 12
    assert eng.abort_request("a1") is None  # forgotten: the id can be used again
    eng.add_request("a1", reqs[1][1], reqs[1][2])
    outs = drive(eng)
    assert tokens_of(outs) == tokens_of(ref)


def test_known_tokens_window():
    from deepinfer_jax.host_scheduler.request import Request

    r = Request("w", [10, 11, 12, 13], params(), seed=0)
    r.output_token_ids = [20, 21]
    full = r.all_token_ids
    for a in range(0, 7):
        for b in range(a, 9):
            assert r.known_tokens(a, b) == full[a:b]


# =========================================================================== 9. soak


def soak_workload(seed=11, n=300):
    """300 requests: shared prefixes (prefix hits and, under a small pool, evictions), chunked
    prompts, stop ids, min_tokens, logprobs, and a few prompt-logprob requests."""
    rng = np.random.default_rng(seed)
    bases = [rand_prompt(rng, int(rng.integers(40, 160))) for _ in range(6)]
    reqs = []
    for i in range(n):
        prompt = bases[i % 6][:int(rng.integers(16, 160))] + rand_prompt(rng, int(rng.integers(1, 60)))
        kw = dict(seed=int(rng.integers(0, 2**40)), max_tokens=int(rng.integers(1, 48)), logprobs=2)
        if i % 7 == 3:
            kw["stop_token_ids"] = [int(rng.integers(1, V))]
        if i % 11 == 5:
            kw["min_tokens"] = min(3, kw["max_tokens"])
        if i % 29 == 7:
            kw["prompt_logprobs"] = 1
        reqs.append((f"s{i}", prompt, params(**kw)))
    return reqs


def _full_outputs(outs) -> dict:
    return {rid: [(tuple(c.token_ids), c.finish_reason, c.cumulative_logprob,
                   [sorted(d.items()) for d in (c.logprobs or [])]) for c in o.outputs]
                  + [o.prompt_logprobs and [sorted(d.items()) if d else None for d in o.prompt_logprobs]]
            for rid, o in outs.items()}


@pytest.mark.parametrize("async_sched", [True, False], ids=["async", "sync"])
def test_soak_under_preemption_and_eviction(async_sched):
    """Nothing is lost or mixed up over 300 requests when memory is short: every request returns
    once, with the tokens and logprobs of a run with ample memory, through many preemptions and
    prefix-cache evictions."""
    reqs = soak_workload()
    kw = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, async_scheduling=async_sched)
    ref, *_ = run(make_ec(num_blocks=400, **kw), reqs)
    outs, eng, _, _ = run(make_ec(num_blocks=24, **kw), reqs)
    assert eng.scheduler.num_preemptions >= 50, eng.scheduler.num_preemptions
    assert eng.scheduler.pool.evictions >= 100, eng.scheduler.pool.evictions
    assert eng.scheduler.pool.hits > 0
    assert _full_outputs(outs) == _full_outputs(ref)


def _plans(rec) -> list:
    return [[dataclasses.astuple(r) for r in out.rows] + [sorted(out.preempted)] for _, out, _ in rec.log]


@pytest.mark.parametrize("async_sched", [True, False])
def test_decode_fast_path_plans_what_the_general_path_plans(async_sched, monkeypatch):
    """``Scheduler._decode_rows`` (steady decode rows) duplicates ``_num_new_tokens`` + ``_row``
    for speed: with it off, every step's plan (every field of every row, the preemptions) and
    every output are the same, under chunked prompts, prefix hits and evictions, preemptions,
    stop ids, min_tokens bans and prompt logprobs."""
    reqs = soak_workload(seed=12, n=80)
    kw = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, async_scheduling=async_sched,
              num_blocks=24)
    outs, eng, _, rec = run(make_ec(**kw), reqs, record=True)
    assert eng.scheduler.num_preemptions > 0 and eng.scheduler.pool.hits > 0
    monkeypatch.setattr(Scheduler, "decode_fast_path", False)
    ref, _, _, ref_rec = run(make_ec(**kw), reqs, record=True)
    assert _plans(rec) == _plans(ref_rec)
    assert _full_outputs(outs) == _full_outputs(ref)
    # the fast path did plan most decode rows (the comparison is not vacuous)
    n_decode = sum(1 for _, out, _ in rec.log for r in out.rows if not r.is_prefill and r.num_tokens == 1)
    assert n_decode > 500
