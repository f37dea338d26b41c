"""DSpark speculative decoding in the engine (CPU), on the shipped trained model, whose drafts
are often accepted: greedy output with speculation equals greedy output without it, token for
token, under chunked prefill, preemption and prefix-cache hits, for fixed-length and varlen
verification; seeded sampling stays reproducible; the counters add up; bad settings are refused.

Every engine runs one token bucket, so every step has one padded shape (on CPU XLA's results can
depend on a step's shape; see tests/test_engine.py).
"""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np
import pytest

from deepinfer_jax import LLM, SamplingParams
from deepinfer_jax.models.registry import DEFAULT_MODEL

# 8 running requests, 128-token steps (prompts of up to ~250 tokens are chunked)
BASE = dict(max_num_seqs=8, max_num_batched_tokens=128, token_buckets=(128,), max_model_len=384,
            prefix_replay_tokens=64, progress=False)
# 20 blocks of 64 positions: 8 requests of up to ~280 positions do not fit at once, so some are
# preempted. A preempted request that re-enters through a prefix-cache hit replays a bounded
# tail (an approximation, FEATURES §5) wherever the schedule put it, so these runs keep the
# prefix cache off; prefix hits are tested on a schedule both runs share
PREEMPT = dict(BASE, num_blocks=20, enable_prefix_caching=False)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SRC = pathlib.Path(__file__).resolve().parents[1] / "deepinfer_jax"


@pytest.fixture(scope="module")
def prompts():
    return make_prompts()


def make_prompts():
    """16 prompts cut from the project's own Python (never in the model's training data); the
    last four share a 192-token prefix with the first (prefix-cache hits)."""
    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.models.registry import resolve_model
    from deepinfer_jax.tokenizer.loader import load_tokenizer

    d = resolve_model(DEFAULT_MODEL, progress=False)
    cfg = ModelConfig.from_json(d)
    tok = load_tokenizer(d, bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id)
    files = sorted(f for f in SRC.rglob("*.py") if f.stat().st_size > 4000)
    rng = np.random.default_rng(5)
    out = []
    for f in rng.choice(files, size=12, replace=False):
        ids = tok.encode(f.read_text())
        n = int(rng.integers(40, 250))
        s = int(rng.integers(0, max(1, len(ids) - n)))
        out.append(ids[s:s + n])
    base = (out[0] * 5)[:192]
    out += [base + ids[:k] for ids, k in zip(out[1:5], (3, 17, 40, 64))]
    return out


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def fresh(llm):
    """The engine with an empty prefix cache and fresh stats: a hit replays a bounded tail (an
    approximation), so runs compared token for token start from the same cache contents."""
    assert llm.engine.scheduler.pool.reset_prefix_cache()
    llm.stats.reset()
    return llm


@pytest.fixture(scope="module")
def plain_preempt(prompts):
    llm = LLM(DEFAULT_MODEL, **PREEMPT)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return tokens(outs), llm.stats.summary()


@pytest.fixture(scope="module")
def spec_fixed():
    return LLM(DEFAULT_MODEL, spec_decode="dspark", spec_varlen=False, **BASE)


@pytest.fixture(scope="module")
def plain():
    return LLM(DEFAULT_MODEL, **BASE)


# async varlen (rows planned before the previous step's accept counts, Algorithm 1's lengths) in
# the default run; fixed-length async is also covered there by the tests on ``spec_fixed`` (an
# async engine) against the plain engine, so the other two combinations are slow twins
@pytest.mark.parametrize("varlen,async_scheduling", [pytest.param(False, True, marks=pytest.mark.slow),
                                                     pytest.param(True, False, marks=pytest.mark.slow),
                                                     (True, True)])
def test_greedy_with_speculation_equals_without(prompts, plain_preempt, varlen, async_scheduling):
    """Chunked prompts and preemptions; fixed-length and varlen verification, sync and async
    (async: rows planned before the previous step's accept counts, corrected on the device).
    Without plain steps: on this CPU verification never pays, and varlen would (rightly) run
    none (plain steps between verification steps: the tests below)."""
    ref, ref_summary = plain_preempt
    llm = LLM(DEFAULT_MODEL, spec_decode="dspark", spec_varlen=varlen, async_scheduling=async_scheduling,
              **(dict(spec_plain_steps=False) if varlen else {}), **PREEMPT)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    s = llm.stats.summary()
    assert tokens(outs) == ref
    # the run exercised what it claims to
    assert any(len(p) > BASE["max_num_batched_tokens"] for p in prompts)
    assert s["preemptions"] > 0
    assert s["drafts_accepted"] > 0 and s["drafts_verified"] > s["drafts_accepted"]  # accepts and rejects
    assert s["mean_accepted_length"] == pytest.approx(1 + s["drafts_accepted"] / s["spec_rows"])
    assert s["mean_accepted_length"] > 1.2
    assert s["steps"] < ref_summary["steps"]  # fewer steps than one per token: the point of it
    device_rows = llm.engine.scheduler.num_device_rows
    assert device_rows > 0 if async_scheduling else device_rows == 0
    # per-request metrics add up (the engine's counters also count work lost to preemptions)
    m = [o.metrics for o in outs]
    assert sum(x.draft_tokens_accepted for x in m) <= s["drafts_accepted"]
    assert sum(x.draft_tokens_verified for x in m) <= s["drafts_verified"]
    assert all(sum(x.draft_accepted_per_position) == x.draft_tokens_accepted for x in m)
    assert all(x.draft_tokens_verified <= x.draft_tokens_proposed for x in m)
    per_pos = s["drafts_accepted_per_position"]
    assert sum(per_pos) == s["drafts_accepted"] and per_pos == sorted(per_pos, reverse=True)
    assert "mean accepted length" in llm.stats.summary_line()


def test_prefix_hits_with_speculation(prompts, plain, spec_fixed):
    """The same prefix hits in both runs (one request fills the cache, then four share its prefix)."""
    outs = {}
    for name, llm in (("plain", plain), ("spec", spec_fixed)):
        first = fresh(llm).generate(prompts[:1], GREEDY, use_tqdm=False)
        rest = llm.generate(prompts[12:], GREEDY, use_tqdm=False)
        assert llm.stats.summary()["cache_hit_tokens"] >= 3 * 128 and llm.stats.summary()["preemptions"] == 0
        outs[name] = tokens(first + rest)
    assert outs["spec"] == outs["plain"]


def test_varlen_plans_shorter_rows_when_steps_cost_more(prompts, plain, spec_fixed):
    """With a forward time that grows steeply with the step's tokens, Algorithm 1 verifies fewer
    drafts than the fixed length; the output stays the greedy output. With STS calibration
    (``spec_calibration``): every verified row reaches the calibrator, which refits its
    per-position temperatures away from 1 and feeds them to the plan."""
    llm = LLM(DEFAULT_MODEL, spec_decode="dspark", spec_varlen=True, spec_calibration=True, precompile=False,
              **BASE)
    cal = llm.engine.spec_calibrator
    cal.refit_every = 16
    assert llm.engine.scheduler.spec_confidence == cal.probabilities
    llm.engine.scheduler.spec_sps = lambda B: 1.0 / (1.0 + 0.2 * B)
    assert llm.engine.scheduler.spec_buckets == BASE["token_buckets"]  # the plan's stopping points
    llm.engine.scheduler.spec_buckets = None  # that cost rises with every token, not per bucket
    ref = tokens(fresh(plain).generate(prompts[:6], GREEDY, use_tqdm=False))
    assert tokens(llm.generate(prompts[:6], GREEDY, use_tqdm=False)) == ref
    assert tokens(fresh(spec_fixed).generate(prompts[:6], GREEDY, use_tqdm=False)) == ref
    s, sf = llm.stats.summary(), spec_fixed.stats.summary()
    assert s["spec_rows"] and s["drafts_verified"] / s["spec_rows"] < sf["drafts_verified"] / sf["spec_rows"]
    # rows whose drafts' confidences were on the host (all but those planned right after a prefill)
    assert s["spec_rows"] - 6 <= cal.observed <= s["spec_rows"]
    assert cal.fits >= 1 and np.all(np.isfinite(cal.temperature_K)) and np.all(cal.temperature_K > 0)
    assert np.any(np.abs(cal.temperature_K - 1) > 1e-3)


def test_fixed_length_below_the_compiled_block(prompts, plain, spec_fixed):
    """``Scheduler.draft_limit`` = 2 on the engine compiled for K = 5 (bench_spec's fixed2): rows
    verify at most 2 drafts, no draft position past 2 is ever accepted, and the greedy output is
    unchanged."""
    ref = tokens(fresh(plain).generate(prompts[:6], GREEDY, use_tqdm=False))
    sch = spec_fixed.engine.scheduler
    sch.draft_limit = 2
    try:
        assert tokens(fresh(spec_fixed).generate(prompts[:6], GREEDY, use_tqdm=False)) == ref
    finally:
        sch.draft_limit = None
    s = spec_fixed.stats.summary()
    assert s["spec_rows"] > 0 and s["drafts_accepted"] > 0
    assert max(st.drafts_verified / st.spec_rows for st in spec_fixed.stats.steps if st.spec_rows) <= 2
    assert 1.5 < s["drafts_verified"] / s["spec_rows"] <= 2  # mostly full rows of 2
    assert s["drafts_accepted_per_position"][:2] != [0, 0] and not any(s["drafts_accepted_per_position"][2:])


def test_seeded_sampling_with_speculation(prompts, plain, spec_fixed):
    """Sampled rows: the same seeds give the same tokens run to run; with the ``coupled`` rule
    every emitted token is the one plain sampling draws at that (seed, position), so the output
    equals the output without speculation."""
    p = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=20, seed=7, ignore_eos=True)
    ref = tokens(fresh(plain).generate(prompts[:4], p, use_tqdm=False))
    coupled = LLM(DEFAULT_MODEL, spec_decode="dspark", spec_rule="coupled", precompile=False, **BASE)
    assert tokens(coupled.generate(prompts[:4], p, use_tqdm=False)) == ref
    assert coupled.stats.summary()["drafts_accepted"] > 0
    b1 = tokens(fresh(spec_fixed).generate(prompts[:4], p, use_tqdm=False))
    b2 = tokens(fresh(spec_fixed).generate(prompts[:4], p, use_tqdm=False))
    assert b1 == b2 and b1 != ref  # the uniform rule: same distribution, other draws


def test_stops_inside_a_verified_block(prompts, plain, spec_fixed):
    """max_tokens, stop tokens and min_tokens cut a block where they apply, as without speculation."""
    ref = tokens(fresh(plain).generate(prompts[:4], GREEDY, use_tqdm=False))
    short = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    assert tokens(fresh(spec_fixed).generate(prompts[:4], short, use_tqdm=False)) == [r[:7] for r in ref]
    # the stop id: a token whose first occurrence in the greedy output is at position 6 or later,
    # so min_tokens=3 bans it nowhere the greedy path would have emitted it
    r = ref[0]
    first = next((i for i in range(6, len(r)) if r[i] not in r[:i]), None)
    assert first is not None, f"no new token after position 6 in {r}"
    stop_id = r[first]
    stop = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_id], min_tokens=3, ignore_eos=True)
    for llm in (plain, spec_fixed):
        out = fresh(llm).generate(prompts[:1], stop, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == ref[0][:first + 1] and out.finish_reason == "stop"


def test_min_tokens_bans_hold_per_verification_slot(prompts, plain, spec_fixed):
    """Under min_tokens the banned ids (EOS, stop ids) hold on each verification slot that samples
    an output before min_tokens, and only there. Rows still carry drafts (before, they had none
    until min_tokens outputs were out), and the output equals the plain engine's under the same
    bans. The stop id is one the model emits early, so the bans change the output."""
    ref = tokens(fresh(plain).generate(prompts[:4], GREEDY, use_tqdm=False))
    stop_id = int(np.argmax(np.bincount(np.concatenate([r[:8] for r in ref]))))
    # whole output under the bans: any draft verified was verified under them
    held = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12, stop_token_ids=[stop_id], ignore_eos=True)
    # the bans end inside a block: the stop id is allowed from output 6 on
    ends = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=6, stop_token_ids=[stop_id], ignore_eos=True)
    for params in (held, ends):
        want = tokens(fresh(plain).generate(prompts[:4], params, use_tqdm=False))
        outs = fresh(spec_fixed).generate(prompts[:4], params, use_tqdm=False)
        assert tokens(outs) == want
        assert want != [r[:len(t)] for r, t in zip(ref, want)]  # the bans changed the output
        for o in outs:
            t = o.outputs[0].token_ids
            assert stop_id not in t[:params.min_tokens]
            assert o.outputs[0].finish_reason == ("stop" if t[-1] == stop_id else "length")
        if params is held:
            assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
            assert sum(o.metrics.draft_tokens_accepted for o in outs) > 0
        else:
            assert any(o.outputs[0].finish_reason == "stop" for o in outs)


def test_spec_config_errors_and_aliases(monkeypatch):
    from deepinfer_jax.config import ModelConfig, preset
    from deepinfer_jax.engine_config import EngineConfig
    from deepinfer_jax.models.registry import resolve_model

    cfg = ModelConfig.from_json(resolve_model(DEFAULT_MODEL, progress=False))
    blk = cfg.dspark_block_size
    ec = EngineConfig(spec_decode="dspark").resolve(cfg)
    assert (ec.spec_decode, ec.num_draft_tokens, ec.spec_varlen) == ("dspark", blk, True)
    assert EngineConfig().resolve(cfg).spec_decode == "off"  # off by default
    with pytest.raises(ValueError, match="num_draft_tokens=9"):
        EngineConfig(spec_decode="dspark", num_draft_tokens=9).resolve(cfg)
    with pytest.raises(ValueError, match="spec_decode='eagle'"):
        EngineConfig(spec_decode="eagle").resolve(cfg)
    with pytest.raises(ValueError, match="max_backtracking_tokens=2"):
        EngineConfig(spec_decode="dspark", max_backtracking_tokens=2).resolve(cfg)
    with pytest.raises(ValueError, match="spec_calibration=True: calibrates the confidences of varlen"):
        EngineConfig(spec_decode="dspark", spec_varlen=False, spec_calibration=True).resolve(cfg)
    with pytest.raises(ValueError, match="spec_calibration=1: must be a bool"):
        EngineConfig(spec_decode="dspark", spec_calibration=1).resolve(cfg)
    # plain steps: on with varlen on one attention-DP rank, off otherwise; refused where they cannot run
    assert ec.spec_plain_steps is True
    assert EngineConfig(spec_decode="dspark", spec_varlen=False).resolve(cfg).spec_plain_steps is False
    assert EngineConfig(spec_decode="dspark", spec_plain_steps=False).resolve(cfg).spec_plain_steps is False
    assert EngineConfig().resolve(cfg).spec_plain_steps is False
    with pytest.raises(ValueError, match="spec_plain_steps=True: chooses between verification and plain steps"):
        EngineConfig(spec_decode="dspark", spec_varlen=False, spec_plain_steps=True).resolve(cfg)
    with pytest.raises(ValueError, match="spec_plain_steps=True: every attention-DP rank runs the same step program"):
        EngineConfig(spec_decode="dspark", spec_plain_steps=True, dp=2).resolve(cfg)
    with pytest.raises(ValueError, match="spec_plain_steps='yes': must be a bool"):
        EngineConfig(spec_decode="dspark", spec_plain_steps="yes").resolve(cfg)
    with pytest.raises(ValueError, match="spec_rule='always'"):
        EngineConfig(spec_decode="dspark", spec_rule="always").resolve(cfg)
    no_stages = dataclasses.replace(preset("v41-tiny"), dspark_block_size=0)
    with pytest.raises(ValueError, match="no DSpark stages"):
        EngineConfig(spec_decode="dspark").resolve(no_stages)
    # DeepInfer's switches: keyword aliases and environment variables
    ec = EngineConfig.from_kwargs(DEEPINFER_USE_NEXTN_DECODE=1, DEEPINFER_ENABLE_MTP_VARLEN=0).resolve(cfg)
    assert (ec.spec_decode, ec.spec_varlen) == ("dspark", False)
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "1")
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "0")
    ec = EngineConfig().resolve(cfg)
    assert (ec.spec_decode, ec.spec_varlen) == ("dspark", False)
    assert EngineConfig(spec_decode="off").resolve(cfg).spec_decode == "off"  # the field wins
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "maybe")
    with pytest.raises(ValueError, match="DEEPINFER_USE_NEXTN_DECODE='maybe'"):
        EngineConfig().resolve(cfg)


def test_forced_acceptance_benchmark_mode(prompts):
    """``spec_force_accept=1``: every verified draft is accepted whatever the target says (a
    benchmark knob for random weights), so each verification row emits all its tokens."""
    llm = LLM(DEFAULT_MODEL, spec_decode="dspark", spec_varlen=False, spec_force_accept=1.0, precompile=False, **BASE)
    outs = llm.generate(prompts[:3], GREEDY, use_tqdm=False)
    s = llm.stats.summary()
    assert s["drafts_verified"] > 0 and s["drafts_accepted"] == s["drafts_verified"]
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in outs)
    with pytest.raises(ValueError, match="spec_force_accept=1.5"):
        LLM(DEFAULT_MODEL, spec_decode="dspark", spec_force_accept=1.5, precompile=False, **BASE)


def test_logprobs_prompt_logprobs_and_n_with_speculation(prompts, plain, spec_fixed):
    """Per-token logprobs (emitted from verification slots), prompt logprobs (their logits rows
    follow the verification slots) and n > 1 samples agree with the engine without speculation."""
    p = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2, prompt_logprobs=1, n=2)
    a = fresh(plain).generate(prompts[:2], p, use_tqdm=False)
    b = fresh(spec_fixed).generate(prompts[:2], p, use_tqdm=False)
    assert spec_fixed.stats.summary()["drafts_accepted"] > 0
    for x, y in zip(a, b):
        assert [c.token_ids for c in x.outputs] == [c.token_ids for c in y.outputs]
        assert len(y.outputs) == 2 and y.outputs[0].token_ids == y.outputs[1].token_ids
        for cx, cy in zip(x.outputs, y.outputs):
            for lx, ly in zip(cx.logprobs, cy.logprobs):
                assert lx.keys() == ly.keys()
                np.testing.assert_allclose([v.logprob for v in lx.values()], [v.logprob for v in ly.values()],
                                           atol=1e-4)
        px = [d for d in x.prompt_logprobs if d is not None]
        py = [d for d in y.prompt_logprobs if d is not None]
        assert len(px) == len(py) == len(x.prompt_token_ids) - 1
        for dx, dy in zip(px, py):
            assert dx.keys() == dy.keys()
            np.testing.assert_allclose([v.logprob for v in dx.values()], [v.logprob for v in dy.values()], atol=1e-4)


class PatternSwitch:
    """A ``DraftSwitch`` stand-in that makes steps plain by a fixed pattern (whatever the costs)."""

    def __init__(self, pattern):
        self.pattern, self.i, self.plain = pattern, 0, False

    def choose(self, decoding_rows, have_drafts, theta_spec, theta_plain):
        self.plain = self.pattern[self.i % len(self.pattern)]
        self.i += 1
        return self.plain


def with_switch(llm, switch, verify_seconds=1.0, plain_seconds=1.0):
    """Plain steps on an engine built without start-up profiling: ``switch`` decides, and the
    planner's step rates are the given constants."""
    sch = llm.engine.scheduler
    sch.spec_switch = switch
    sch.spec_sps = lambda B: 1.0 / verify_seconds
    sch.spec_plain_sps = lambda B: 1.0 / plain_seconds
    return llm


# verification and plain steps in every order: a plain step after a verification step (its rows'
# last tokens and positions come from that step's accept counts on the device), a verification
# step after a plain one (no drafts at hand: it drafts for the next), plain after plain
PATTERN = (False, False, True, False, True, True, False)


@pytest.mark.parametrize("async_scheduling", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_plain_steps_between_verification_steps_keep_greedy_output(prompts, plain_preempt, async_scheduling):
    """Plain steps (``spec_plain_steps``: no drafts verified or proposed) interleaved with
    verification steps, under chunked prompts and preemptions: the greedy output is unchanged."""
    ref, _ = plain_preempt
    llm = with_switch(LLM(DEFAULT_MODEL, spec_decode="dspark", spec_varlen=True, async_scheduling=async_scheduling,
                          precompile=False, **PREEMPT), PatternSwitch(PATTERN))
    assert llm.engine.ec.spec_plain_steps
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    s = llm.stats.summary()
    assert tokens(outs) == ref
    assert s["spec_plain_steps"] >= s["steps"] // 4 and s["preemptions"] > 0
    assert s["drafts_accepted"] > 0 and s["drafts_verified"] > s["drafts_accepted"]
    assert "plain steps" in llm.stats.summary_line()
    if async_scheduling:
        assert llm.engine.scheduler.num_device_rows > 0


def test_plain_steps_sample_as_the_plain_engine(prompts, plain):
    """Seeded sampling with the ``coupled`` rule emits the token plain sampling draws at each
    (seed, position), so with plain steps in between the output still equals the plain engine's;
    logprobs of plain-step tokens come out as well."""
    p = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=20, seed=7, ignore_eos=True, logprobs=2)
    ref = fresh(plain).generate(prompts[:4], p, use_tqdm=False)
    llm = with_switch(LLM(DEFAULT_MODEL, spec_decode="dspark", spec_rule="coupled", precompile=False, **BASE),
                      PatternSwitch(PATTERN))
    outs = llm.generate(prompts[:4], p, use_tqdm=False)
    assert tokens(outs) == tokens(ref)
    assert llm.stats.summary()["spec_plain_steps"] > 0 and llm.stats.summary()["drafts_accepted"] > 0
    for x, y in zip(ref, outs):
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert lx.keys() == ly.keys()
            np.testing.assert_allclose([v.logprob for v in lx.values()], [v.logprob for v in ly.values()], atol=1e-4)


@pytest.mark.parametrize("verify_seconds", [3.0, 1.0])
def test_varlen_stops_speculating_where_verification_does_not_pay(prompts, plain, verify_seconds):
    """With verification steps 3x as slow as plain steps no draft pays for itself: after the
    first verification steps the engine runs plain steps (probing now and then). With equal step
    costs every accepted draft is a gain: a step is plain only where no draft fits (prompt
    tokens fill it) or none can come (every row its request's last token). The output is the
    greedy one either way."""
    from deepinfer_jax.host_scheduler.spec_switch import DraftSwitch

    ref = tokens(fresh(plain).generate(prompts[:8], GREEDY, use_tqdm=False))
    llm = with_switch(LLM(DEFAULT_MODEL, spec_decode="dspark", spec_varlen=True, precompile=False, **BASE),
                      DraftSwitch(), verify_seconds=verify_seconds)
    sch = llm.engine.scheduler
    schedule, last_rows, columns = sch.schedule, [], []

    def planned():  # per plain decode-only step: whether each row's sample is its request's last
        out = schedule()
        if out.spec_plain and out.num_rows and not out.num_prefill_tokens:
            last_rows.append([sch.requests[r.request_id].num_outputs_planned >= GREEDY.max_tokens for r in out.rows])
            columns.append(len(out.decode) if out.decode is not None else 0)
        return out

    sch.schedule = planned
    assert tokens(llm.generate(prompts[:8], GREEDY, use_tqdm=False)) == ref
    decode_only = [st for st in llm.stats.steps if st.num_decode_tokens and not st.num_prefill_tokens]
    plain_decode = sum(st.spec_plain for st in decode_only)
    assert plain_decode == len(last_rows)
    if verify_seconds > 1:
        assert plain_decode >= 0.8 * len(decode_only), (plain_decode, len(decode_only))
        # runs of plain steps plan their steady decode rows as columns (host_scheduler/decode_cohort.py)
        assert sum(columns) > 0.5 * sum(map(len, last_rows)), (columns, list(map(len, last_rows)))
    else:
        assert all(map(all, last_rows)), last_rows
        assert llm.stats.summary()["drafts_accepted"] > 0
