"""``LLM.generate`` interrupted or failing at any point leaves the LLM usable: the call's requests
are aborted (blocks and slots freed, nothing queued) and the next call gives a fresh engine's
outputs. Also: calls from several threads are serialised, and a non-finite logprob ends the
call with an error instead of a token.

Interrupts are injected at the k-th call of each place the loop passes through (engine step,
runner dispatch, the jitted step itself with a real SIGINT, result fetch, output processing,
the progress bar, queueing, the prompts iterable), for k from the first call to the last.
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import threading

import numpy as np
import pytest

from deepinfer_jax import LLM, SamplingParams
from deepinfer_jax.config import preset
from deepinfer_jax.engine.llm_engine import LLMEngine
from deepinfer_jax.entrypoints import llm as llm_module
from deepinfer_jax.runner.model_runner import StepHandle

SMALL = dict(max_num_seqs=4, max_num_batched_tokens=64, token_buckets=(64,), max_model_len=256,
             yoco_keep_tokens=40, progress=False)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
# two prompts longer than a step (chunked prefill, full prefix-cache blocks), five requests for
# four slots (one waits)
PROMPTS = [np.random.default_rng(s).integers(3, 250, size=n).tolist() for s, n in
           [(1, 100), (2, 70), (3, 20), (4, 9), (5, 40)]]


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module", autouse=True)
def _sigint_raises():
    """Ctrl-C as in a terminal: a process started in the background of a non-interactive shell
    (``cmd &``) inherits SIGINT ignored, and Python then installs no handler for it."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from deepinfer_jax.checkpoint.random_checkpoint import write_random_checkpoint

    d = tmp_path_factory.mktemp("tiny")
    write_random_checkpoint(preset("v41-tiny"), d, seed=3, progress=False)
    return LLM(str(d), **SMALL)


class Counter:
    """Wraps ``fn``; on call number ``k`` raises KeyboardInterrupt before (or after) the call,
    or sends the process a real SIGINT after it."""

    def __init__(self, fn, k: int | None = None, when: str = "before"):
        self.fn, self.k, self.when, self.calls = fn, k, when, 0

    def __call__(self, *a, **kw):
        self.calls += 1
        hit = self.calls == self.k
        if hit and self.when == "before":
            raise KeyboardInterrupt
        out = self.fn(*a, **kw)
        if hit and self.when == "after":
            raise KeyboardInterrupt
        if hit and self.when == "sigint":
            signal.raise_signal(signal.SIGINT)
        return out


def _targets(llm, monkeypatch):
    """name -> a function that installs a Counter there and returns it."""
    def on_instance(obj, attr):
        def install(k, when):
            c = Counter(getattr(obj, attr), k, when)
            monkeypatch.setattr(obj, attr, c)
            return c
        return install

    def on_class(cls, attr):
        def install(k, when):
            c = Counter(getattr(cls, attr), k, when)
            monkeypatch.setattr(cls, attr, lambda self, *a, **kw: c(self, *a, **kw))  # a method
            return c
        return install

    return {"step": on_instance(llm.engine, "step"), "execute": on_instance(llm.runner, "execute"),
            "jit_step": on_instance(llm.runner, "_step"), "fetch": on_class(StepHandle, "fetch"),
            "add_token": on_instance(llm.engine.outputs, "add_token"),
            "queue": on_instance(llm.engine, "_queue"), "bar": on_class(llm_module.tqdm, "update")}


@pytest.fixture(scope="module")
def reference(llm):
    """The fresh engine's tokens, and how often each target is called in one clean run."""
    mp = pytest.MonkeyPatch()
    counters = {name: install(None, "before") for name, install in _targets(llm, mp).items()}
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    mp.undo()
    return tokens(outs), {name: c.calls for name, c in counters.items()}


def assert_idle(llm):
    e, s = llm.engine, llm.engine.scheduler
    assert not e.has_unfinished_requests() and e._inflight is None
    assert not s.waiting and not s.running and not s.requests
    assert s.pool.num_used == 0 and s.pool.num_requests == 0 and s.slots.num_used == 0
    assert not e._groups and not e._states


def _ks(n: int) -> list[int]:
    return sorted({1, 2, max(1, n // 2), n})


CASES = [("step", "before"), ("step", "after"), ("execute", "before"), ("execute", "after"),
         ("jit_step", "sigint"), ("fetch", "before"), ("fetch", "after"), ("fetch", "sigint"),
         ("add_token", "before"), ("add_token", "after"), ("add_token", "sigint"), ("bar", "before"),
         ("queue", "before"), ("queue", "sigint")]


@pytest.mark.parametrize("name, when", CASES)
def test_interrupt_anywhere_leaves_the_llm_usable(llm, reference, monkeypatch, name, when):
    want, calls = reference
    for k in _ks(calls[name]):
        c = _targets(llm, monkeypatch)[name](k, when)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS, GREEDY, use_tqdm=name == "bar")
        assert c.calls >= k
        monkeypatch.undo()
        assert_idle(llm)
        assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want, f"{name} {when} k={k}"


def test_interrupt_with_synchronous_scheduling(llm, reference, monkeypatch):
    """The same, with results processed in the round that dispatched them (an engine of the same
    runner, so nothing is compiled again)."""
    want = reference[0]
    saved = llm.engine
    llm.engine = LLMEngine(llm.runner, dataclasses.replace(llm.engine_config, async_scheduling=False),
                           llm.tokenizer, saved.eos_token_id)
    try:
        counters = {name: install(None, "before") for name, install in _targets(llm, monkeypatch).items()}
        assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want
        calls = {name: c.calls for name, c in counters.items()}
        monkeypatch.undo()
        for name, when in [("execute", "before"), ("fetch", "sigint"), ("add_token", "after")]:
            for k in _ks(calls[name]):
                _targets(llm, monkeypatch)[name](k, when)
                with pytest.raises(KeyboardInterrupt):
                    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
                monkeypatch.undo()
                assert_idle(llm)
                assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want, f"{name} {when} k={k}"
    finally:
        llm.engine = saved
        # the other engine wrote the device blocks this one's prefix cache points at
        saved.scheduler.pool.reset_prefix_cache()


@pytest.mark.parametrize("fail_at", [0, 2, 4])
def test_failing_prompt_iterable(llm, reference, fail_at):
    def prompts():
        for i, p in enumerate(PROMPTS):
            if i == fail_at:
                raise OSError("reading prompts failed")
            yield p

    with pytest.raises(OSError, match="reading prompts failed"):
        llm.generate(prompts(), GREEDY, use_tqdm=False)
    assert_idle(llm)
    assert tokens(llm.generate(iter(PROMPTS), GREEDY, use_tqdm=False)) == reference[0]


def test_a_second_interrupt_during_clean_up(llm, reference, monkeypatch):
    """Ctrl-C twice: the first interrupts the run, the second the clean-up. The next call
    starts by finishing the clean-up."""
    want = reference[0]
    _targets(llm, monkeypatch)["fetch"](2, "before")
    orig = llm.engine.abort_all
    monkeypatch.setattr(llm.engine, "abort_all", Counter(orig, 1, "before"))
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert llm.engine.has_unfinished_requests()  # the clean-up did not run
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want
    assert_idle(llm)


def test_threads_calling_generate_are_serialised(llm, reference):
    want = reference[0]
    batches = [PROMPTS, PROMPTS[1:3], PROMPTS[::-1], PROMPTS[4:]]
    expected = [want, want[1:3], want[::-1], want[4:]]
    results, errors = {}, []

    def run(i):
        try:
            results[i] = tokens(llm.generate(batches[i % 4], GREEDY, use_tqdm=False))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert errors == []
    assert results == {i: expected[i % 4] for i in range(6)}
    assert_idle(llm)


def test_non_finite_logprob_raises_and_aborts(llm, reference, monkeypatch):
    """NaN model outputs (faked in the fetched results) end the call with a RuntimeError naming
    the request and step, not with token 0 and cumulative_logprob=nan."""
    orig = StepHandle.fetch
    calls = [0]

    def nan_fetch(self):  # the second result that samples a token turns NaN
        res = orig(self)
        rows = [i for i, r in enumerate(self.sched.rows) if r.sample]
        calls[0] += bool(rows)
        if calls[0] == 2 and rows:
            res.logprob = res.logprob.copy()
            res.logprob[rows[0]] = np.nan
            res.token_ids = np.zeros_like(res.token_ids)
        return res

    monkeypatch.setattr(StepHandle, "fetch", nan_fetch)
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    with pytest.raises(RuntimeError, match=r"request '\d+' \(sample 0\): step \d+ sampled token 0 with logprob "
                                           r"nan: the model's outputs are not finite"):
        llm.generate(PROMPTS, sp, use_tqdm=False)
    monkeypatch.undo()
    assert_idle(llm)
    outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    assert tokens(outs) == reference[0]
    assert all(np.isfinite(o.outputs[0].cumulative_logprob) for o in outs)


def test_interrupt_between_planning_and_dispatch_forgets_unwritten_blocks(llm, monkeypatch):
    """The scheduler hands a step's full blocks to the prefix cache when it plans the step; if the
    step never reaches the device, a later hit on them would read whatever the blocks held
    before. The follow-up must equal an engine without prefix caching."""
    q = np.random.default_rng(99).integers(3, 250, size=150).tolist()  # two full blocks
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    want = LLM(llm.model_dir, enable_prefix_caching=False, **SMALL).generate([q], sp, use_tqdm=False)[0]
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # the free blocks hold other prompts' entries
    for k in (1, 2, 3):  # the first, second, third chunk planned but never dispatched
        _targets(llm, monkeypatch)["execute"](k, "before")
        with pytest.raises(KeyboardInterrupt):
            llm.generate([q], sp, use_tqdm=False)
        monkeypatch.undo()
        assert_idle(llm)
        got = llm.generate([q], sp, use_tqdm=False)[0]
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        np.testing.assert_allclose(got.outputs[0].cumulative_logprob, want.outputs[0].cumulative_logprob, atol=1e-5)
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)


def test_deferred_interrupts_hold_sigint_until_the_outermost_section_ends():
    from deepinfer_jax.interrupts import deferred_interrupts

    done = []
    with pytest.raises(KeyboardInterrupt):
        with deferred_interrupts():
            with deferred_interrupts():
                signal.raise_signal(signal.SIGINT)
                done.append("inner")
            done.append("outer")
    assert done == ["inner", "outer"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with deferred_interrupts():  # nothing pending: nothing raised
        pass
