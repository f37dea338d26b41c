"""``host_scheduler/decode_cohort.py``: steady async decode rows planned as columns give the plans,
step inputs and outputs of the row path, and do plan most decode rows."""

from __future__ import annotations

import dataclasses
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))

from test_scheduler import _full_outputs, make_ec, params, rand_prompt, run, soak_workload  # noqa: E402

from deepinfer_jax.host_scheduler.scheduler import Scheduler  # noqa: E402


def _plans(rec) -> list:
    return [[dataclasses.astuple(r) for r in out.rows] + [sorted(out.preempted)] for _, out, _ in rec.log]


def _cohort_rows(rec) -> int:
    return sum(len(out.decode) for _, out, _ in rec.log if out.decode is not None)


def decode_workload(seed: int, n: int) -> list:
    """Short prompts and output lengths spread from 1 to 60: requests finish at every step, the
    queue admits new ones into the running batch, some min_tokens bans, stop ids, prompt logprobs."""
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(n):
        kw = dict(seed=int(rng.integers(0, 2**40)), max_tokens=int(rng.integers(1, 60)), ignore_eos=bool(i % 3))
        if i % 7 == 3:
            kw["min_tokens"] = min(5, kw["max_tokens"])
        if i % 11 == 5:
            kw["stop_token_ids"] = [int(rng.integers(4, 60))]
        if i % 13 == 6:
            kw["prompt_logprobs"] = 2
        reqs.append((f"d{i}", rand_prompt(rng, int(rng.integers(2, 40))), params(**kw)))
    return reqs


@pytest.mark.parametrize("workload", ["soak", "decode"])
def test_cohort_plans_what_the_row_path_plans(workload, monkeypatch):
    """With the cohort on and off, every step's plan (every field of every row, in order; the
    preemptions) and every output are the same: under chunked prompts, prefix hits and
    evictions, preemptions (``soak``), and requests finishing and admitted at nearly every step
    (``decode``)."""
    if workload == "soak":
        reqs = soak_workload(seed=12, n=80)
        kw = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, num_blocks=24)
    else:
        reqs = decode_workload(seed=5, n=150)
        kw = dict(max_num_seqs=32, max_num_batched_tokens=40, max_model_len=256, num_blocks=200)
    ec = make_ec(async_scheduling=True, **kw)
    outs, eng, _, rec = run(ec, reqs, record=True)
    monkeypatch.setattr(Scheduler, "decode_cohort", False)
    ref, _, _, ref_rec = run(ec, reqs, record=True)
    assert _cohort_rows(ref_rec) == 0
    assert _plans(rec) == _plans(ref_rec)
    assert _full_outputs(outs) == _full_outputs(ref)
    # the cohort planned most of the decode rows (the comparison is not vacuous)
    n_decode = sum(1 for _, out, _ in rec.log for r in out.rows if not r.is_prefill and r.num_tokens == 1)
    assert _cohort_rows(rec) > 0.5 * n_decode, (_cohort_rows(rec), n_decode)
    if workload == "soak":
        assert eng.scheduler.num_preemptions > 0 and eng.scheduler.pool.hits > 0


def test_sync_scheduling_plans_no_cohort():
    """Without async scheduling no row has a placeholder: the cohort stays empty."""
    reqs = decode_workload(seed=6, n=20)
    _, _, _, rec = run(make_ec(async_scheduling=False, max_num_seqs=8, max_num_batched_tokens=40,
                               max_model_len=256, num_blocks=100), reqs, record=True)
    assert _cohort_rows(rec) == 0


def _leaves_equal(a, b) -> bool:
    import jax

    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    return ta == tb and all(np.asarray(x).dtype == np.asarray(y).dtype and np.array_equal(x, y)
                            for x, y in zip(la, lb))


def _host_engine(n_requests: int, seed: int, accept: float = 0.6, **ec_kwargs):
    """(runner, engine, model config): an async ``LLMEngine`` over the shipped model's tokenizer and
    Engram hashing whose step call returns synthetic outputs (``bench_host_path.host_only_runner``;
    drafts accepted with probability ``accept``), holding ``n_requests`` random requests that
    finish at different steps, half of them sampled."""
    from bench_host_path import host_only_runner

    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.engine.llm_engine import LLMEngine
    from deepinfer_jax.engine_config import EngineConfig
    from deepinfer_jax.models.registry import DEFAULT_MODEL, resolve_model
    from deepinfer_jax.sampling.params import SamplingParams
    from deepinfer_jax.tokenizer.loader import load_tokenizer

    model_dir = resolve_model(DEFAULT_MODEL, progress=False)
    cfg = ModelConfig.from_json(model_dir)
    tok = load_tokenizer(model_dir, bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id)
    ec = EngineConfig.from_kwargs(precompile=False, **ec_kwargs).resolve(cfg, "cpu")
    runner = host_only_runner(model_dir, ec, cfg, seed=0, accept=accept)
    engine = LLMEngine(runner, dataclasses.replace(ec, async_scheduling=True), tok, cfg.eos_token_id,
                       vocab_size=cfg.vocab_size)
    engine.forward_estimator = None
    rng = np.random.default_rng(seed)
    engine.add_requests([(f"q{i}", rng.integers(4, 2000, int(rng.integers(2, 30))).tolist(),
                          SamplingParams(temperature=float(i % 2), seed=i, max_tokens=int(rng.integers(1, 40)),
                                         ignore_eos=True))
                         for i in range(n_requests)])
    return runner, engine, cfg


def test_cohort_step_inputs_equal_the_row_path_inputs():
    """``build_step_input`` of a step planned as columns (``_decode_step_input``) equals the row
    path's on the same rows built as ``ScheduledRow`` objects, array for array (the shipped
    model's Engram hashing, sampling arrays reused between steps), at every such step of an
    engine run whose requests finish and are admitted throughout."""
    from deepinfer_jax.base.scheduler_output import SchedulerOutput
    from deepinfer_jax.runner.step_inputs import build_step_input
    from deepinfer_jax.sampling.sampler import SamplingReuse

    runner, engine, cfg = _host_engine(48, seed=3, max_num_seqs=16, max_num_batched_tokens=64, token_buckets=(16, 64))
    checked = []
    orig = runner.step_inputs
    ref_reuse = SamplingReuse()

    def step_inputs(sched, T, R, Td):
        if sched.decode is not None and not sched.tail_rows:
            kw = dict(num_tokens=T, num_rows=R, num_decoder_tokens=Td, cache_config=runner.cache_config,
                      hasher=runner.hasher, vocab=cfg.vocab_size, prompt_lp=False)
            got = build_step_input(sched, **kw)
            rows = SchedulerOutput(sched.step_id, sched.rows, [], 0, [])  # the same rows, as objects
            want = build_step_input(rows, reuse=ref_reuse, **kw)
            checked.append(_leaves_equal(got, want))
        return orig(sched, T, R, Td)

    runner.step_inputs = step_inputs
    outs = engine.run_until_done()
    assert len(outs) == 48
    assert len(checked) > 20 and all(checked), (len(checked), checked.count(False))


def _plain_pattern_plan(orig, period: int):
    """``Scheduler._plan_drafts`` that makes runs of ``period`` plain steps alternate with runs of
    as many verification steps (the step id decides), whatever the switch would choose."""
    def plan(self, budget):
        drafts, plain = orig(self, budget)
        if (self.next_step_id // period) % 2 == 0:
            return {}, True
        return drafts, plain
    return plan


@pytest.mark.parametrize("period, share", [(3, 0.25), (8, 0.5)])
def test_speculative_plain_steps_use_the_cohort_and_plan_what_the_row_path_plans(period, share, monkeypatch):
    """A speculative engine's plain steps plan their steady decode rows as columns (device rows),
    with the row path's plans, step inputs and outputs: with the cohort on and off, every step's
    rows (every field, in order) and every request's tokens are the same, and each plain step
    planned as columns alone builds the row path's step inputs array for array. Runs of plain
    steps alternate with verification steps (the cohort starts over after each), requests finish
    and are admitted throughout, random acceptance."""
    from deepinfer_jax.base.scheduler_output import SchedulerOutput
    from deepinfer_jax.runner.step_inputs import build_step_input
    from deepinfer_jax.sampling.sampler import SamplingReuse

    monkeypatch.setattr(Scheduler, "_plan_drafts", _plain_pattern_plan(Scheduler._plan_drafts, period))

    def run_engine(check_inputs: bool):
        runner, engine, cfg = _host_engine(40, seed=4, accept=0.5, max_num_seqs=16, max_num_batched_tokens=96,
                                           token_buckets=(16, 32, 96), spec_decode="dspark", spec_varlen=False)
        plans, checked, n_cols = [], [], 0
        orig = runner.step_inputs
        ref_reuse = SamplingReuse()

        def step_inputs(sched, T, R, Td):
            nonlocal n_cols
            plans.append((sched.spec_plain, [dataclasses.astuple(r) for r in sched.rows]))
            if sched.decode is not None:
                assert sched.spec_plain  # columns only in plain steps
                n_cols += len(sched.decode)
                if check_inputs and not sched.tail_rows:
                    kw = dict(num_tokens=T, num_rows=R, num_decoder_tokens=Td, cache_config=runner.cache_config,
                              hasher=runner.hasher, vocab=cfg.vocab_size, prompt_lp=False,
                              spec_slots=runner.spec_slots, verify_slots=0)
                    got = build_step_input(sched, **kw)
                    rows = SchedulerOutput(sched.step_id, sched.rows, [], 0, [], spec_plain=True)
                    want = build_step_input(rows, reuse=ref_reuse, **kw)
                    checked.append(_leaves_equal(got, want))
            return orig(sched, T, R, Td)

        runner.step_inputs = step_inputs
        outs = engine.run_until_done()
        tokens = {o.request_id: o.outputs[0].token_ids for o in outs}
        return plans, tokens, checked, n_cols, engine

    plans, tokens, checked, n_cols, engine = run_engine(True)
    monkeypatch.setattr(Scheduler, "decode_cohort", False)
    ref_plans, ref_tokens, _, ref_cols, _ = run_engine(False)
    assert ref_cols == 0
    assert plans == ref_plans
    assert tokens == ref_tokens and len(tokens) == 40
    n_plain_decode = sum(1 for plain, rows in plans if plain for r in rows if r[5] and len(r[3]) == 1)
    # (a run of plain steps plans its first step's rows, and the rows of requests that verified
    # drafts in the step before, on the row path; from its third step on, the steady ones as columns)
    assert n_cols > share * n_plain_decode, (n_cols, n_plain_decode)
    assert any(not plain for plain, _ in plans)  # verification steps between the plain runs
    assert len(checked) > 5 and all(checked), (len(checked), checked.count(False))
    assert engine.stats.summary()["drafts_accepted"] > 0
