"""Batch-invariant inference and deterministic sampling (``EngineConfig.batch_invariant``).

With the mode on, a request with its own seed gets the same tokens, logprobs and top logprobs,
bit for bit, alone and in any batch (other requests around it, another padded step size, its
prompt chunked differently), sync or async, run after run and in another process; with DSpark
speculation at a fixed draft length too. With the mode off the same scenario differs on this
CPU (the inverse test), so the equality is the mode's doing.

Scenario: the random ``v41-tiny`` preset, two token buckets (50 and 64) so that a request alone
runs at another padded size than in a batch (a 50-token prompt alone is one T=50 step; in the
batch it is chunked into T=64 steps; a decode step alone is T=50, in the batch T=64), compact
YOCO truncation on (the default). ``decoder_buckets=(64,)`` keeps the decoder at the step's size,
so each engine compiles two step variants (and its first step once more: the fresh cache). The device twin (``-m device``) runs the same
evidence on a GPU with the kernels on (``DEEPINFER_KERNELS=auto``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from deepinfer_jax import LLM, SamplingParams
from conftest import on_gpu

MODEL = "v41-tiny"
# two padded sizes: alone (1 row) a request runs at T=50, in a batch at T=64
BASE = dict(max_num_seqs=8, max_num_batched_tokens=64, token_buckets=(50, 64), decoder_buckets=(64,),
            progress=False, precompile=False)
LOW, HIGH = 3, 250  # prompt ids of v41-tiny (no specials, no DSpark noise id 255)


def make_prompts(n: int, seed: int, lengths=(5, 50)) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(LOW, HIGH, int(k)).tolist() for k in rng.integers(*lengths, n)]


def make_params(n: int, max_tokens: int = 8) -> list[SamplingParams]:
    """Per-request seeds; greedy, plain temperature and filtered rows mixed; 3 top logprobs."""
    kinds = [dict(temperature=0.0), dict(temperature=0.8), dict(temperature=1.0, top_k=20),
             dict(temperature=0.7, top_p=0.9), dict(temperature=1.2, min_p=0.05)]
    return [SamplingParams(max_tokens=max_tokens, seed=1000 + i, logprobs=3, ignore_eos=True, **kinds[i % len(kinds)])
            for i in range(n)]


def result(out) -> dict:
    """A request's tokens, the sampled tokens' logprobs and the top logprobs (ids, values)."""
    c = out.outputs[0]
    top = [sorted(((lp.rank, t, lp.logprob) for t, lp in d.items() if lp.rank is not None)) for d in c.logprobs]
    return dict(tokens=np.asarray(c.token_ids),
                logprob=np.asarray([d[t].logprob for d, t in zip(c.logprobs, c.token_ids)], np.float32),
                top_ids=np.asarray([[t for _, t, _ in row] for row in top]),
                top_logprobs=np.asarray([[v for _, _, v in row] for row in top], np.float32))


def assert_same(got: dict, want: dict, what: str) -> None:
    for k in ("tokens", "logprob", "top_ids", "top_logprobs"):
        np.testing.assert_array_equal(got[k], want[k], err_msg=f"{what}: {k}")


def generate(llm, prompts, params) -> list[dict]:
    return [result(o) for o in llm.generate(prompts, params, use_tqdm=False)]


def alone(llm, prompts, params) -> list[dict]:
    return [generate(llm, [p], [sp])[0] for p, sp in zip(prompts, params)]


# five prompts of 5..49 tokens and one of 50 (a single T=50 prefill alone)
PROMPTS = make_prompts(5, 1) + [make_prompts(1, 12, (50, 51))[0]]
PARAMS = make_params(len(PROMPTS))


@pytest.fixture(scope="module")
def llm_on():
    return LLM(MODEL, batch_invariant=True, **BASE)


@pytest.fixture(scope="module")
def batch_on(llm_on):
    return generate(llm_on, PROMPTS, PARAMS)


def test_batch_equals_alone(llm_on, batch_on):
    """Each request of a batch (chunked prefills, T=64 steps) equals the request alone (one T=50
    prefill, T=50 decode steps): tokens, logprobs, top logprobs."""
    assert llm_on.engine_config.batch_invariant
    for i, (got, want) in enumerate(zip(alone(llm_on, PROMPTS, PARAMS), batch_on)):
        assert_same(got, want, f"request {i} alone vs in the batch")
    assert len({tuple(r["tokens"]) for r in batch_on}) == len(PROMPTS)  # the rows really differ


def test_sync_reversed_and_rerun(llm_on, batch_on):
    """Synchronous scheduling, the batch in reverse order (other rows, other chunk boundaries)
    and a second run give the same results."""
    sync = LLM(MODEL, batch_invariant=True, async_scheduling=False, **BASE)  # shares the compiled steps
    for i, (got, want) in enumerate(zip(generate(sync, PROMPTS, PARAMS), batch_on)):
        assert_same(got, want, f"request {i} sync vs async")
    rev = generate(llm_on, PROMPTS[::-1], PARAMS[::-1])[::-1]
    again = generate(llm_on, PROMPTS, PARAMS)
    for i in range(len(PROMPTS)):
        assert_same(rev[i], batch_on[i], f"request {i} in the reversed batch")
        assert_same(again[i], batch_on[i], f"request {i} on a second run")


@pytest.mark.slow  # its own engine compile (~90 s here); evidence for the mode, not a behaviour of it
def test_mode_off_differs():
    """The inverse: the same scenario with the mode off does not give the same numbers alone and
    in the batch for every request (XLA's sums and products change with the padded step size)."""
    llm = LLM(MODEL, batch_invariant=False, **BASE)
    batch = generate(llm, PROMPTS, PARAMS)
    solo = alone(llm, PROMPTS, PARAMS)
    same = [all(np.array_equal(a[k], b[k]) for k in a) for a, b in zip(solo, batch)]
    assert not all(same), "with batch_invariant=False every request matched: the inverse test lost its case"


def test_env_alias(monkeypatch):
    from deepinfer_jax.config import preset
    from deepinfer_jax.engine_config import EngineConfig

    cfg = preset(MODEL)
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    assert EngineConfig().resolve(cfg, "cpu").batch_invariant is True
    assert EngineConfig(batch_invariant=False).resolve(cfg, "cpu").batch_invariant is False
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "0")
    assert EngineConfig().resolve(cfg, "cpu").batch_invariant is False
    assert EngineConfig.from_kwargs(DEEPINFER_BATCH_INVARIANT="1").resolve(cfg, "cpu").batch_invariant is True
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "maybe")
    with pytest.raises(ValueError, match="DEEPINFER_BATCH_INVARIANT='maybe'"):
        EngineConfig().resolve(cfg, "cpu")
    with pytest.raises(ValueError, match=r"EngineConfig.batch_invariant='yes': must be a bool"):
        EngineConfig(batch_invariant="yes").resolve(cfg, "cpu")
    with pytest.raises(ValueError, match="both DEEPINFER_BATCH_INVARIANT and its field"):
        EngineConfig.from_kwargs(DEEPINFER_BATCH_INVARIANT="1", batch_invariant=True)


# --------------------------------------------------------------------------- needle in a batch

NEEDLE_ENGINE = dict(max_num_seqs=48, max_num_batched_tokens=64, token_buckets=(64,), decoder_buckets=(64,),
                     progress=False, precompile=False)


@pytest.mark.slow  # its own engine compile (48 rows; ~45 s here); the fast twin is test_batch_equals_alone
def test_needle_among_many():
    """One prompt alone vs at a random position among 40 others (48 running rows, 64-token steps:
    its prefill is chunked wherever the others leave room)."""
    llm = LLM(MODEL, batch_invariant=True, **NEEDLE_ENGINE)
    rng = np.random.default_rng(3)
    needle, sp = PROMPTS[2], PARAMS[1]
    want = generate(llm, [needle], [sp])[0]
    others = make_prompts(40, 4)
    at = int(rng.integers(0, len(others) + 1))
    prompts = others[:at] + [needle] + others[at:]
    params = make_params(len(others))
    params = params[:at] + [sp] + params[at:]
    got = generate(llm, prompts, params)[at]
    assert_same(got, want, f"needle at position {at} of {len(prompts)}")


# --------------------------------------------------------------------------- DSpark speculation


@pytest.mark.slow  # the speculative step compiles separately (~2 min here); no fast twin
def test_fixed_length_speculation():
    """DSpark speculation with a fixed draft length (``spec_varlen=False``): a request in the
    batch equals the request alone, and the batch reruns identically."""
    llm = LLM(MODEL, batch_invariant=True, spec_decode="dspark", spec_varlen=False,
              **dict(BASE, token_buckets=(64,)))
    prompts, params = PROMPTS[:4], PARAMS[:4]
    batch = generate(llm, prompts, params)
    for i, (got, want) in enumerate(zip(alone(llm, prompts, params), batch)):
        assert_same(got, want, f"request {i} alone vs in the batch (speculation)")
    for i, (got, want) in enumerate(zip(generate(llm, prompts, params), batch)):
        assert_same(got, want, f"request {i} second run (speculation)")


# --------------------------------------------------------------------------- across processes

_CHILD = r"""
import json, sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests"]
import deepinfer_jax
from test_batch_invariance import PROMPTS, PARAMS, BASE, MODEL, generate
from deepinfer_jax import LLM
llm = LLM(MODEL, batch_invariant=True, **BASE)
out = generate(llm, PROMPTS[::-1], PARAMS[::-1])[::-1]
print(json.dumps([{k: v.tolist() for k, v in r.items()} for r in out]))
"""


@pytest.mark.slow  # a second process compiles the engine's steps again (~2 min here); the fast twin is test_sync_reversed_and_rerun
def test_across_processes(batch_on):
    """A fresh process (its own compile) gives the same tokens and logprobs, bit for bit."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", _CHILD, root], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    child = json.loads(p.stdout.strip().splitlines()[-1])
    for i, (got, want) in enumerate(zip(child, batch_on)):
        assert_same({k: np.asarray(v, want[k].dtype) for k, v in got.items()}, want, f"request {i} in another process")


# --------------------------------------------------------------------------- GPU (kernels on)


# a request alone runs at T=32 (8 rows), in the batch at T=128 (48 rows); 3 compiled variants per mode
DEVICE_ENGINE = dict(max_num_seqs=48, max_num_batched_tokens=128, token_buckets=(32, 128), row_buckets=(8, 48),
                     decoder_buckets=(128,), progress=False, precompile=False, kernels="auto")
DEVICE_PICKS = (0, 17, 40)


def device_workload(vocab: int):
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, min(vocab, 4000), int(k)).tolist() for k in rng.integers(5, 120, 41)]
    return prompts, make_params(len(prompts), max_tokens=12)


@pytest.mark.device
@pytest.mark.skipif(not on_gpu(), reason="needs a GPU")
def test_device_batch_invariance():
    """The evidence above on a GPU with the Pallas kernels on (``kernels="auto"``), on the shipped
    trained model: a request alone (T=32 / T=128 steps, 8 rows) vs in a batch of 41 (T=128, 48
    rows, chunked prefills), sync vs async, a second run."""
    from deepinfer_jax.models.registry import DEFAULT_MODEL

    llm = LLM(DEFAULT_MODEL, batch_invariant=True, **DEVICE_ENGINE)
    prompts, params = device_workload(llm.model_config.vocab_size)
    batch = generate(llm, prompts, params)
    print("kernel fallbacks:", llm.runner.kernel_fallbacks())
    for i in DEVICE_PICKS:
        assert_same(generate(llm, [prompts[i]], [params[i]])[0], batch[i], f"request {i} alone vs in the batch")
    for i, (got, want) in enumerate(zip(generate(llm, prompts, params), batch)):
        assert_same(got, want, f"request {i} second run")
    sync = LLM(DEFAULT_MODEL, batch_invariant=True, async_scheduling=False, **DEVICE_ENGINE)
    for i, (got, want) in enumerate(zip(generate(sync, prompts, params), batch)):
        assert_same(got, want, f"request {i} sync vs async")


@pytest.mark.device
@pytest.mark.skipif(not on_gpu(), reason="needs a GPU")
def test_device_mode_off_report():
    """The inverse on the GPU, reported rather than asserted (a GPU's default numerics may or may
    not depend on the batch for this workload): which picked requests differ alone vs in the batch."""
    from deepinfer_jax.models.registry import DEFAULT_MODEL

    off = LLM(DEFAULT_MODEL, batch_invariant=False, **DEVICE_ENGINE)
    prompts, params = device_workload(off.model_config.vocab_size)
    batch = generate(off, prompts, params)
    same = {i: all(np.array_equal(a[k], batch[i][k]) for k in a)
            for i, a in ((i, generate(off, [prompts[i]], [params[i]])[0]) for i in DEVICE_PICKS)}
    print(f"mode off on the GPU: request alone == in the batch: {same}")
