"""scripts/kernel_census.py: the kernels of a compiled program counted per source function
(loop bodies once per trip), and a profiler trace's kernels matched back to them."""

from __future__ import annotations

import collections
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import load_script


def _rows_sum(x):
    return x / jnp.sum(x, axis=-1, keepdims=True)


def _cols_sum(x):
    return x / jnp.sum(x, axis=0, keepdims=True)


def _program(x):
    # (at 32 x 32 XLA:CPU of jax 0.12 runs the loop as one inlined call; at 64 x 64 as a loop)
    y = jnp.exp(jnp.sin(x) @ x.T)

    def body(_, y):
        return _cols_sum(_rows_sum(y))

    y = jax.lax.fori_loop(0, 7, body, y)  # a rolled loop of known trip count
    return jnp.sort(y, axis=-1)


def test_census_counts_loop_bodies_per_trip_and_names_functions():
    kc = load_script("kernel_census")
    x = jnp.asarray(np.random.default_rng(0).standard_normal((64, 64)), jnp.float32)
    text = jax.jit(_program).lower(x).compile().as_text()
    res = kc.census(text)
    fns = res["by_function"]
    body = {k: n for k, n in fns.items() if k.endswith((":_rows_sum", ":_cols_sum"))}
    assert body and all(k.startswith("test_kernel_census.py:") for k in body)
    # however XLA fuses the body (one fusion or several), each of the 7 trips launches its kernels
    assert all(n % 7 == 0 for n in body.values())
    # the loop and the sort after it launch once per run, not once per trip
    assert res["by_op"]["while"] == 1 and res["by_op"]["sort"] == 1


def test_trace_events_match_the_census():
    kc = load_script("kernel_census")
    import step_profile

    x = jnp.asarray(np.random.default_rng(1).standard_normal((64, 64)), jnp.float32)
    f = jax.jit(_program)
    text = f.lower(x).compile().as_text()
    res = kc.census(text)
    f(x).block_until_ready()
    prof = step_profile.profile_steps(lambda: f(x), steps=2)
    events = step_profile.kernel_events(prof["trace"])
    joined = kc.join_trace(events, res["where"], steps=2)
    assert joined["events"] > 0 and joined["matched_fraction"] > 0.9
    # every traced thunk ran as often per run as the census says (loop bodies: once per trip;
    # XLA:CPU evaluates the loop's condition inside the loop's own thunk, so the census's
    # per-trip condition kernels do not appear as events of their own)
    times = {i["name"]: i["times"] for i in kc.launched(text)}
    ran = collections.Counter(op for _, op, _, _ in events)
    assert ran and all(n == 2 * times[op] for op, n in ran.items())
    assert max(times[op] for op in ran) == 7
    body = [r for r in joined["by_function"] if r["function"].endswith((":_rows_sum", ":_cols_sum"))]
    assert sum(r["kernels_per_step"] for r in body) >= 7 and all(r["ms_per_step"] > 0 for r in body)


def test_unmatched_events_are_named_costliest_first():
    """Events the census cannot place (a library GEMM's own kernels) are listed by kernel name
    and hlo op, per step, the costliest first, next to the "(not in the census)" total."""
    kc = load_script("kernel_census")
    where = {"fusion.1": "layers/norms.py:rms_norm"}
    events = [("loop_fusion", "fusion.1", 0, 1000), ("sm90_xmma_gemm_bf16", "custom-call.3", 10, 5000),
              ("sm90_xmma_gemm_bf16", "custom-call.3", 20, 5000), ("memcpy", "copy.9", 30, 400)]
    joined = kc.join_trace(events, where, steps=2)
    assert joined["matched_fraction"] == 0.25
    lost = {r["function"]: r for r in joined["by_function"]}["(not in the census)"]
    assert lost["kernels_per_step"] == 1.5 and lost["ms_per_step"] == pytest.approx(0.0052)
    assert [(u["kernel"], u["hlo_op"], u["kernels_per_step"]) for u in joined["unmatched"]] == [
        ("sm90_xmma_gemm_bf16", "custom-call.3", 1.0), ("memcpy", "copy.9", 0.5)]
    assert joined["unmatched"][0]["ms_per_step"] == pytest.approx(0.005)


def test_caller_is_the_model_part_not_the_helper():
    kc = load_script("kernel_census")
    pkg = "/x/deepinfer_jax/"
    frames = {1: (pkg + "models/deepseek_v41.py", "Model.__call__", 10, 0),
              2: (pkg + "layers/norms.py", "rms_norm", 20, 1),
              3: (pkg + "base/batch_invariant.py", "row_mean", 30, 2)}
    assert kc.caller(frames, 3) == "layers/norms.py:rms_norm"
    assert kc.caller(frames, 1) == "models/deepseek_v41.py:Model.__call__"
    assert kc.caller({5: ("/usr/lib/x.py", "f", 1, 0)}, 5) == "x.py:f"  # no model part: the innermost
    assert kc.caller(frames, 99) == "(no metadata)"


def test_engine_step_census_and_trace(tmp_path, capsys):
    kc = load_script("kernel_census")
    out = tmp_path / "census.json"
    assert kc.main(["--concurrency", "2", "--input-len", "8", "--output-len", "4", "--trace-steps", "1",
                    "--top", "10", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["variant"][:2] == [2, 2] and res["census"]["kernels"] > 100
    assert any(k.startswith("layers/") for k in res["census"]["by_caller"])
    tr = res["trace"]
    assert tr["steps"] == 1 and tr["matched_fraction"] > 0.9 and tr["variants"] == [str(tuple(res["variant"]))]
    assert "kernels from" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--concurrency", "0"], "--concurrency: 0 must be >= 1"),
    (["--trace-steps", "-1"], "--trace-steps: -1 must be >= 0"),
    (["--engine", "[1]"], "--engine: '[1]' is not a JSON object"),
])
def test_bad_flags_refused_by_name(argv, message, capsys):
    kc = load_script("kernel_census")
    with pytest.raises(SystemExit) as ei:
        kc.main(argv)
    assert ei.value.code == 2 and message in capsys.readouterr().err
