"""The host's pairing counters under async speculative decoding (``host_scheduler/scheduler.py``),
without a model: rounds are scheduled one step ahead of the processed results, exactly in the
engine's order (schedule N+1, then process N), and results are applied as ``LLMEngine._apply``
applies them (``commit_verification``, the emitted tokens, the next drafts).

What must hold after every event: a decoding request has ``num_computed == num_tokens_planned -
1`` (planned = known tokens + ``num_pending``, counted optimistically as 1 + drafts per row in
flight); a row planned before the previous step's results takes its tokens from the device
(placeholders) and is counted in ``num_device_rows``; processing a verification row with ``a`` of
``l`` drafts accepted removes its ``1 + l`` optimistic tokens from ``num_pending`` and ``l - a``
positions from ``num_computed`` (the device rolled them back and shifted the later row), so the
request's bookkeeping ends where a run that never proposed the rejected drafts would be; results of
an older epoch (a preempted request) are never paired with the new one's rows.
"""

from __future__ import annotations

import numpy as np
import pytest

from deepinfer_jax.config import preset
from deepinfer_jax.engine_config import EngineConfig
from deepinfer_jax.host_scheduler.request import Request
from deepinfer_jax.host_scheduler.scheduler import Scheduler
from deepinfer_jax.sampling.params import SamplingParams

K = 3  # v41-tiny's DSpark block


def make(max_tokens=40, n_req=1, prompt_len=10):
    ec = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, block_tokens=16, precompile=False,
                      spec_decode="dspark", num_draft_tokens=K, spec_varlen=False).resolve(preset("v41-tiny"))
    sch = Scheduler(ec, max_model_len=256)
    reqs = []
    for i in range(n_req):
        r = Request(f"r{i}", list(range(10 + i, 10 + i + prompt_len)),
                    SamplingParams(max_tokens=max_tokens, ignore_eos=True).validate(), seed=i, eos_token_id=None)
        sch.add_request(r)
        reqs.append(r)
    return sch, reqs


def apply(sch, out, accepted: dict[str, int], rng):
    """Process one step's results as the engine does: per sampled row, ``a`` accepted drafts
    (clipped to the row's), the emitted tokens (accepted drafts + correction or bonus), the next
    block of drafts. Rows of an older epoch are dropped."""
    for row in out.rows:
        req = sch.requests.get(row.request_id)
        if req is None or row.epoch != req.epoch or not row.sample:
            continue
        a = min(accepted.get(row.request_id, 0), row.num_drafts)
        sch.commit_verification(req, row.num_drafts, a)
        req.output_token_ids.extend(int(t) for t in rng.integers(20, 40, size=a + 1))
        n = 0 if out.spec_plain else K  # a plain step drafts nothing
        req.draft_token_ids = [int(t) for t in rng.integers(20, 40, size=n)]
        req.draft_confidence = [0.0] * n


def check(req):
    assert req.num_pending >= 0
    assert req.num_computed == req.num_tokens_planned - 1, (req.num_computed, req.num_tokens_planned)


def test_async_rounds_pair_with_their_results():
    """Prefill, then rows planned one step ahead with all drafts assumed accepted, then results
    with 0..K accepted: the counters stay paired and the outputs grow by a + 1 per row."""
    rng = np.random.default_rng(0)
    sch, (req,) = make()
    out = sch.schedule()  # step 0: the prefill, samples the first token
    assert [r.num_drafts for r in out.rows] == [0] and req.num_computed == 10 and req.num_pending == 1
    inflight = out
    emitted = 0
    for step, a in enumerate([1, 0, 3, 2, 3, 0, 1], start=1):
        nxt = sch.schedule()  # planned before `inflight`'s results: its tokens come from the device
        (row,) = nxt.rows
        assert row.sample and row.token_ids[0] == -1 and row.prev_row == 0
        assert row.num_drafts == K  # step 1 too: the prefill step's block is on the device
        assert req.num_pending == (inflight.rows[0].num_drafts + 1) + (row.num_drafts + 1)
        check(req)
        before = len(req.output_token_ids)
        apply(sch, inflight, {req.request_id: a}, rng)
        got = len(req.output_token_ids) - before
        assert got == min(a, inflight.rows[0].num_drafts) + 1
        emitted += got
        assert req.num_pending == row.num_drafts + 1  # only the newer row is still in flight
        check(req)
        inflight = nxt
    assert sch.num_device_rows == 7
    apply(sch, inflight, {req.request_id: 2}, rng)
    assert req.num_pending == 0 and req.num_computed == req.num_tokens - 1
    # every position up to the newest token computed once, none of the rejected drafts counted
    assert req.num_tokens == 10 + emitted + 3


def test_stale_results_are_not_paired_after_a_preemption():
    """A request preempted while a row is in flight gets a new epoch; the old row's results are
    dropped, and the re-admitted request starts from its known tokens with nothing pending."""
    rng = np.random.default_rng(1)
    sch, (req,) = make()
    first = sch.schedule()
    apply(sch, first, {}, rng)
    inflight = sch.schedule()  # a verification row of the prefill's block (host drafts now)
    assert inflight.rows[0].num_drafts == K
    old_epoch = req.epoch
    sch._preempt(req)
    assert req.epoch != old_epoch and req.num_pending == 0
    n_out = len(req.output_token_ids)
    apply(sch, inflight, {req.request_id: K}, rng)  # the stale row: dropped
    assert len(req.output_token_ids) == n_out
    out = sch.schedule()  # re-admitted: recomputes its known tokens, samples once more
    (row,) = out.rows
    assert row.epoch == req.epoch and row.num_drafts == 0 and row.sample
    assert req.num_pending == 1
    check(req)


@pytest.mark.parametrize("a", [0, K])
def test_limits_count_in_flight_drafts_as_accepted(a):
    """max_tokens is never overrun: rows in flight count as fully accepted when the next row's
    drafts are capped, whatever the results turn out to be."""
    rng = np.random.default_rng(2)
    sch, (req,) = make(max_tokens=6)
    inflight = sch.schedule()
    for _ in range(50):  # a bounded loop: broken counters fail the test instead of hanging it
        assert sch.has_unfinished()
        nxt = sch.schedule()
        assert req.num_outputs_planned <= 6
        apply(sch, inflight, {req.request_id: a}, rng)
        if len(req.output_token_ids) >= 6:
            sch.finish(req, type(req.status).FINISHED_LENGTH)
            break
        inflight = nxt
    else:
        pytest.fail("max_tokens=6 not reached in 50 rounds")
    assert len(req.output_token_ids) <= 6 + K


def test_plain_steps_carry_no_drafts_and_the_next_row_expects_none():
    """Plain steps (``SchedulerOutput.spec_plain``) among verification steps, scheduled one step
    ahead: a plain step's rows carry no drafts; a row planned while a plain step is in flight
    expects no drafts from it (and so verifies none); the bookkeeping holds throughout; and the
    step inputs of a plain step have one logits row per row and no draft slots."""
    from deepinfer_jax.models.cache import CacheConfig
    from deepinfer_jax.runner.step_inputs import build_step_input

    class Pattern:
        def __init__(self):
            self.i, self.plain = 0, False

        def choose(self, decoding_rows, have_drafts, theta_spec, theta_plain):
            self.plain = (False, True, True, False, False, True)[self.i % 6]
            self.i += 1
            return self.plain

    sch, reqs = make(max_tokens=30, n_req=3)
    sch.spec_varlen = True
    sch.spec_switch = Pattern()
    sch.spec_sps = sch.spec_plain_sps = lambda B: 1.0
    ec = sch.ec
    cc = CacheConfig(num_slots=ec.max_num_seqs, num_blocks=ec.num_blocks, block_tokens=ec.block_tokens,
                     max_blocks_per_seq=ec.blocks_per_seq, spec_tokens=K)
    rng = np.random.default_rng(0)
    prev = None
    seen_plain = seen_after_plain = 0
    for _ in range(200):  # bounded: broken counters fail the test instead of hanging it
        if not sch.has_unfinished():
            break
        out = sch.schedule()
        if out.spec_plain:
            seen_plain += 1
            assert all(r.num_drafts == 0 for r in out.rows)
            inp = build_step_input(out, num_tokens=64, num_rows=4, num_decoder_tokens=None, cache_config=cc,
                                   hasher=None, vocab=256, prompt_lp=False, spec_slots=K, verify_slots=0)
            assert inp.draft_RK.shape == (4, 0) and inp.batch.logits_indices.shape == (4,)
        elif out.rows:
            inp = build_step_input(out, num_tokens=64, num_rows=4, num_decoder_tokens=None, cache_config=cc,
                                   hasher=None, vocab=256, prompt_lp=False, spec_slots=K)
            assert inp.draft_RK.shape == (4, K) and inp.batch.logits_indices.shape == (4 * (K + 1),)
        if prev is not None and prev.spec_plain and not out.spec_plain:
            after = [r for r in out.rows if r.prev_row >= 0]
            seen_after_plain += len(after)
            assert all(r.num_drafts == 0 for r in after)  # the plain step in flight drafts none
        if prev is not None:
            apply(sch, prev, {r.request_id: 1 for r in prev.rows}, rng)
            for q in reqs:
                if q.request_id in sch.requests and len(q.output_token_ids) >= 30:
                    sch.finish(q, type(q.status).FINISHED_LENGTH)
        for q in sch.running:
            check(q)
        prev = out
    else:
        pytest.fail("not finished in 200 rounds")
    assert seen_plain > 3 and seen_after_plain > 0
