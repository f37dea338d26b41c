"""``scripts/step_profile.py``: kernel families, busy and idle time from a profiler trace."""

from __future__ import annotations

import pytest

from conftest import load_script


@pytest.fixture(scope="module")
def prof():
    return load_script("step_profile")


def test_families_busy_and_idle(prof):
    us = 1000
    events = [  # name, hlo_op, start ns, duration ns: two steps of one GEMM, a fusion and our kernel
        ("sm90_xmma_gemm_bf16", "dot.1", 0, 40 * us), ("loop_convert_fusion", "convert.3", 50 * us, 10 * us),
        ("mhc_sinkhorn", "custom-call.2", 55 * us, 10 * us),  # overlaps the fusion (another stream)
        ("sm90_xmma_gemm_bf16", "dot.1", 100 * us, 40 * us), ("loop_convert_fusion", "convert.3", 150 * us, 10 * us),
        ("mhc_sinkhorn", "custom-call.2", 160 * us, 10 * us),
    ]
    b = prof.breakdown(events, steps=2)
    assert b["families"] == {"GEMM (library)": pytest.approx(0.04), "convert fusions": pytest.approx(0.01),
                             "ours: Pallas kernels": pytest.approx(0.01)}
    assert b["span_ms"] == pytest.approx(0.085) and b["busy_ms"] == pytest.approx(0.0575)  # 115 us of 170
    assert b["idle_fraction"] == pytest.approx(1 - 115 / 170)
    assert b["top_kernels"][0] == dict(name="sm90_xmma_gemm_bf16", family="GEMM (library)", ms=pytest.approx(0.04), calls=1)
    assert prof.breakdown([], steps=3)["idle_fraction"] is None


def test_a_real_trace_on_this_machine(prof):
    import jax
    import jax.numpy as jnp

    f = jax.jit(lambda x: jnp.tanh(x @ x) + 1)
    x = jnp.ones((128, 128), jnp.float32)
    jax.block_until_ready(f(x))
    b = prof.profile_steps(lambda: f(x), steps=3)
    assert b["kernels"] >= 1 and b["busy_ms"] > 0 and sum(b["families"].values()) > 0
