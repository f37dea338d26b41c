"""The model and the engine with ``kernels="ffi"`` (kernels_ascend's C++ CPU custom calls).

* Golden: the tiny_fp8 golden run (tiny_bf16 and tiny_fp8_long_allsel: marked slow) (prefill, teacher-forced decode, DSpark drafts) under
  ``use_backend("ffi")`` passes test_golden's checks unchanged (the same bounds: the FFI ops
  differ from the references only in fp32 summation order and libm's exp, see test_ffi_ops.py).
* Engine: ``LLM(kernels="ffi")`` batches as it runs one prompt at a time and matches the
  reference engine's greedy tokens; every op it traces goes through a custom call.
* Set-up: ``kernels`` is validated; a missing library raises what to install, and the other
  backends keep working.
"""

from __future__ import annotations

import jax
import pytest

import test_golden as golden_checks
from golden_run import run_golden
from test_engine import BASE, GREEDY, model_dir, prompts_of, tokens  # noqa: F401  (model_dir: fixture)
from deepinfer_jax import LLM, SamplingParams
from deepinfer_jax.config import preset
from deepinfer_jax.engine_config import EngineConfig
from deepinfer_jax.kernels_pallas import ops


# test_golden's fp8 LOGIT_MAX: the largest op-order difference it allows in any one logit. Where
# two logit vectors differ by at most that much in every entry, their logprobs differ by at most
# twice it (the chosen logit and the log-sum-exp each move by up to LOGIT_MAX), and their argmaxes
# can differ only where the top-2 gap is at most twice it.
LOGIT_MAX = golden_checks.LOGIT_MAX["tiny_fp8"]
NEAR_TIE = 2 * LOGIT_MAX


@pytest.fixture
def traced(monkeypatch):
    """op name -> traced calls of its FFI implementation (the table ops.py reads)."""
    from deepinfer_jax.kernels_ascend import kernels, library

    try:
        kernels.kernels_for("cpu")
    except library.FfiUnavailable as e:
        pytest.fail(str(e))
    counts: dict[str, int] = {}
    for op, fn in list(kernels.OPS.items()):
        def counting(*a, _fn=fn, _op=op, **k):
            counts[_op] = counts.get(_op, 0) + 1
            return _fn(*a, **k)
        monkeypatch.setitem(kernels.OPS, op, counting)
    jax.clear_caches()  # module-level jits traced with the references earlier must retrace
    yield counts
    jax.clear_caches()


# tiny_fp8 covers every op with fp8 experts; the bf16 and long all-selected runs are slow twins
@pytest.mark.parametrize("name", ["tiny_fp8", pytest.param("tiny_bf16", marks=pytest.mark.slow),
                                  pytest.param("tiny_fp8_long_allsel", marks=pytest.mark.slow)])
def test_golden_with_ffi_kernels(golden_dir, traced, name):
    with ops.use_backend("ffi"):
        r = run_golden.__wrapped__(str(golden_dir), name)  # not the lru-cached reference run
    assert {"sparse_attention", "indexer_scores_pool", "topk_positions", "sinkhorn_iterate",
            "moe_experts"} <= set(traced), traced
    run = (name, r)
    golden_checks.test_prefill_logits_and_tokens(run)
    golden_checks.test_prefill_selections(run)
    golden_checks.test_decode_logits_and_tokens(run)
    golden_checks.test_dspark_drafts(run)
    golden_checks.test_caches_after_prefill_and_decode(run)


def test_engine_with_ffi_kernels(model_dir, traced):  # noqa: F811
    prompts = prompts_of(6, seed=5)
    assert any(len(p) > BASE["max_num_batched_tokens"] for p in prompts)  # chunked prefill too
    llm = LLM(model_dir, kernels="ffi", **BASE)
    batched = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert {"sparse_attention", "moe_experts", "sinkhorn_iterate"} <= set(traced), traced
    assert batched == tokens([llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts[:2]]) + batched[2:]
    # the reference engine's greedy tokens, but where its own top-2 gap is a near-tie (this
    # random model's logits are flat): from there on a one-ulp op difference may pick the other.
    # How many prompts stay equal to the end depends on the host CPU (XLA's code and the C++
    # build differ in rounding order), so the check is on the logits: up to the first
    # difference, each chosen token's logprob agrees within the same bound
    lp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    ours_outs = llm.generate(prompts, lp, use_tqdm=False)
    ref_outs = LLM(model_dir, kernels="reference", **BASE).generate(prompts, lp, use_tqdm=False)
    for o, r, b in zip(ours_outs, ref_outs, batched):
        ours, theirs = o.outputs[0].token_ids, r.outputs[0].token_ids
        assert ours == b[:len(ours)]
        i = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))
        for j in range(i):
            got, want = o.outputs[0].logprobs[j][ours[j]].logprob, r.outputs[0].logprobs[j][ours[j]].logprob
            assert abs(got - want) <= NEAR_TIE, f"step {j}: logprob {got} vs reference {want}"
        if i < len(ours):
            top2 = sorted((x.logprob for x in r.outputs[0].logprobs[i].values()), reverse=True)[:2]
            assert top2[0] - top2[1] <= NEAR_TIE, f"step {i}: {ours} vs {theirs}, reference gap {top2}"
    assert ops.default_backend() == "auto"  # the engine's choice, not the process's


def test_kernels_setting_validated():
    assert EngineConfig(kernels="ffi").resolve(preset("v41-tiny")).kernels == "ffi"
    with pytest.raises(ValueError, match="expected 'auto', 'reference' or 'ffi'"):
        EngineConfig(kernels="cuda").resolve(preset("v41-tiny"))
    with pytest.raises(ValueError, match="expected one of"):
        ops.set_backend("pallas")


def test_missing_library_says_what_to_install(monkeypatch):
    import jax.numpy as jnp

    from deepinfer_jax.kernels_ascend import library

    monkeypatch.setattr(library, "CPU_MODULE", "deepinfer_jax.kernels_ascend._not_built")
    monkeypatch.setattr(library, "_registered", set())
    c = jnp.ones((2, 4, 4), jnp.float32)
    with ops.use_backend("ffi"), pytest.raises(library.FfiUnavailable, match=r"install g\+\+.*pip install -e \."):
        ops.sinkhorn_iterate(c, 3, 1e-6)
    assert not library.available("cpu")
    with ops.use_backend("reference"):
        assert ops.sinkhorn_iterate(c, 3, 1e-6).shape == (2, 4, 4)


def test_ffi_on_a_platform_without_targets_falls_back(monkeypatch, caplog):
    import logging

    import jax.numpy as jnp

    from deepinfer_jax.kernels_pallas import indexer_topk_ref

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    s = jnp.asarray([[0.5, 2.0, -jnp.inf, 1.0]], jnp.float32)
    with caplog.at_level(logging.WARNING, logger="deepinfer_jax.kernels"), ops.use_backend("ffi"):
        out = ops.topk_positions(s, 2)
    assert (out == indexer_topk_ref.topk_positions_ref(s, 2)).all()
    assert any("no ffi custom-call targets for platform gpu" in k for k in ops.fallback_counts())
