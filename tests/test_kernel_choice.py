"""Which implementation an op runs (``kernels_pallas/ops.py``): the choice belongs to the engine
instance that traces the step, and a kernel that cannot take a call says why."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.kernels_pallas import ops, sinkhorn_ref

# step shapes no other test compiles: the compiled steps are shared per process, and these tests
# count traces; the random tiny model (the choice of kernels does not depend on the weights)
# compiles in a fraction of the shipped model's time
MODEL = "v41-tiny"
SMALL = dict(max_num_seqs=3, max_num_batched_tokens=40, max_model_len=128)


@pytest.fixture
def counting_cpu_kernel(monkeypatch):
    """A CPU "kernel" for ``sinkhorn_iterate`` that counts how often a trace picks it (and
    computes the reference, so outputs stay the same)."""
    traced = []

    def kernel(comb, n, eps):
        traced.append(comb.shape)
        return sinkhorn_ref.sinkhorn_iterate_ref(comb, n, eps)

    monkeypatch.setitem(ops._KERNELS, ("sinkhorn_iterate", "cpu"), kernel)
    return traced


def test_kernel_choice_belongs_to_the_instance(counting_cpu_kernel):
    from deepinfer_jax import LLM, SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    ref_llm = LLM(MODEL, kernels="reference", progress=False, **SMALL)
    assert counting_cpu_kernel == [], "a kernels='reference' engine traced a kernel"
    assert ops.default_backend() == "auto", "LLM(kernels=...) changed the process default"
    auto_llm = LLM(MODEL, progress=False, **SMALL)
    n_auto = len(counting_cpu_kernel)
    assert n_auto > 0, "LLM() after LLM(kernels='reference') still runs the references"
    # each keeps its own choice: the reference engine neither re-traces nor picks the kernel
    a = ref_llm.generate([[5, 6, 7, 8]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    b = auto_llm.generate([[5, 6, 7, 8]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert len(counting_cpu_kernel) == n_auto
    assert a == b  # the counting kernel computes the reference


def test_use_backend_is_scoped():
    assert ops.current_backend() == ops.default_backend()
    with ops.use_backend("reference"):
        assert ops.current_backend() == "reference"
        with ops.use_backend("auto"):
            assert ops.current_backend() == "auto"
        assert ops.current_backend() == "reference"
    assert ops.current_backend() == ops.default_backend()
    with pytest.raises(ValueError, match="'fast'"):
        with ops.use_backend("fast"):
            pass


def test_a_disabled_op_runs_its_reference(counting_cpu_kernel, monkeypatch):
    """``DEEPINFER_KERNELS_OFF`` / ``set_disabled`` take one op's kernel out; a misspelt op name
    is an error naming it, not a silent no-op."""
    comb = jnp.ones((2, 4, 4), jnp.float32)
    monkeypatch.setattr(ops, "_DISABLED", "moe_experts, sinkhorn_iterate")  # as read from the env
    ops.sinkhorn_iterate(comb, 3, 1e-6)
    assert counting_cpu_kernel == []
    ops.set_disabled(["moe_experts"])
    ops.sinkhorn_iterate(comb, 3, 1e-6)
    assert counting_cpu_kernel == [(2, 4, 4)]
    with pytest.raises(ValueError, match=r"unknown op\(s\) \['sinkhorn_iter'\]"):
        ops.set_disabled("sinkhorn_iter")
    monkeypatch.setattr(ops, "_DISABLED", "f32matmul")
    with pytest.raises(ValueError, match="DEEPINFER_KERNELS_OFF.*'f32matmul'"):
        ops.sinkhorn_iterate(comb, 3, 1e-6)


def test_fallback_is_logged_once_and_counted(caplog, monkeypatch):
    monkeypatch.setattr(ops, "_FALLBACKS", type(ops._FALLBACKS)())
    with caplog.at_level(logging.WARNING, logger="deepinfer_jax.kernels"):
        for _ in range(3):
            ops.note_fallback("moe_experts", "widths (64, 128) are not tiled")
        ops.note_fallback("sparse_attention", "head_dim 24 is not a power of two >= 16")
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2, msgs
    assert "moe_experts" in msgs[0] and "(64, 128)" in msgs[0]
    assert ops.fallback_counts() == {"moe_experts: widths (64, 128) are not tiled": 3,
                                     "sparse_attention: head_dim 24 is not a power of two >= 16": 1}


def _moe_args():
    rng = np.random.default_rng(0)
    T, X, D, F, E = 4, 2, 128, 128, 4
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.bfloat16)
    idx = jnp.asarray(rng.integers(0, E, (T, X)), jnp.int32)
    wt = jnp.asarray(rng.uniform(0.1, 1, (T, X)), jnp.float32)
    w = lambda *s: (jnp.asarray(rng.standard_normal(s) * 0.05, jnp.bfloat16), None)
    return (x, idx, wt, w(E, F, D), w(E, D, F), w(E, F, D), "bf16", 10.0, E)


def test_moe_kernel_dispatch_on_a_multi_device_host(monkeypatch):
    """``LLM(dp=1)`` on a host with several GPUs keeps the MoE kernel: the runner traces with a
    one-device mesh. Several devices and no mesh at all fall back, and say so."""
    from deepinfer_jax.kernels_pallas import moe_gmm

    calls = []
    monkeypatch.setattr(moe_gmm, "is_hopper", lambda: True)
    monkeypatch.setattr(moe_gmm, "moe_experts", lambda *a: calls.append("kernel") or "kernel")
    monkeypatch.setattr(moe_gmm.jax, "device_count", lambda *a: 4)
    monkeypatch.setattr(ops, "_FALLBACKS", type(ops._FALLBACKS)())
    args = _moe_args()
    one = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("dp", "cp"))
    with jax.set_mesh(one):
        assert moe_gmm.moe_experts_op(*args) == "kernel"
    out = moe_gmm.moe_experts_op(*args)  # no context mesh, 4 devices: the reference
    assert isinstance(out, jax.Array) and calls == ["kernel"]
    assert any("no context mesh" in k for k in ops.fallback_counts())
    monkeypatch.setattr(moe_gmm, "is_hopper", lambda: False)
    with jax.set_mesh(one):
        moe_gmm.moe_experts_op(*args)
    assert any("is not an SM90 GPU" in k for k in ops.fallback_counts())
    assert calls == ["kernel"]


def test_fallbacks_show_in_the_engine_stats(monkeypatch):
    """A kernel that falls back inside the engine's step appears in ``llm.stats`` (summary and
    its one-line form)."""
    from deepinfer_jax import LLM, SamplingParams

    def kernel(comb, n, eps):
        ops.note_fallback("sinkhorn_iterate", "a test reason")
        return sinkhorn_ref.sinkhorn_iterate_ref(comb, n, eps)

    monkeypatch.setitem(ops._KERNELS, ("sinkhorn_iterate", "cpu"), kernel)
    monkeypatch.setattr(ops, "_FALLBACKS", type(ops._FALLBACKS)())
    llm = LLM(MODEL, progress=False, **dict(SMALL, max_num_batched_tokens=48))
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    s = llm.stats.summary()
    assert s["kernel_fallbacks"].get("sinkhorn_iterate: a test reason", 0) > 0
    assert "sinkhorn_iterate: a test reason" in llm.stats.summary_line()
