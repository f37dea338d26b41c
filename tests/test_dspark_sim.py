"""``scripts/dspark_sim.py`` on tiny synthetic traces (fast, host only)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("dspark_sim", REPO / "scripts" / "dspark_sim.py")
sim = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sim)


def write_trace(path, pred, obs, temperature=0.0):
    path.write_text(json.dumps({"results": [dict(temperature=temperature, pred_cum=np.asarray(pred).tolist(),
                                                 obs_cum=np.asarray(obs).tolist())]}))
    return str(path)


def linear(fixed_ms, per_ms):
    return sim.load_curve(SimpleNamespace(sps_linear=(fixed_ms, per_ms), sps=None))[0]


def test_single_event_by_hand(tmp_path):
    """One event (2 of 3 drafts accepted): every strategy's throughput by hand."""
    trace = sim.load_trace(write_trace(tmp_path / "t.json", [[0.9, 0.8, 0.1]], [[1, 1, 0]]))[0]
    assert trace["accepted"].tolist() == [2]
    curve = linear(10.0, 1.0)  # seconds(B) = 10 ms + 1 ms * B
    R = 4
    out = sim.simulate(trace, curve, R, steps=3, rng=np.random.default_rng(0))
    for L in range(0, 4):
        name = "none" if L == 0 else f"fixed-{L}"
        want = R * (1 + min(L, 2)) / ((10 + R * (1 + L)) / 1e3)
        assert out[name]["tokens_per_s"] == pytest.approx(want)
        assert out[name]["mean_verify_len"] == L
        assert out[name]["mean_accepted"] == min(L, 2)
    # varlen plans with the predicted cumulative confidences
    want_len = sim.plan_varlen(np.tile([[0.9, 0.8, 0.1]], (R, 1)), curve.sps, cumulative=True)
    assert out["varlen"]["mean_verify_len"] == pytest.approx(want_len.mean())
    assert out["varlen-async"]["mean_verify_len"] == pytest.approx(want_len.mean())


def test_gzipped_trace_reads_as_the_plain_one(tmp_path):
    """Committed traces are gzipped (``dspark_acceptance.json.gz``): the same events either way."""
    import gzip

    plain = write_trace(tmp_path / "t.json", [[0.9, 0.8, 0.1], [0.3, 0.2, 0.1]], [[1, 1, 0], [0, 0, 0]])
    with open(plain, "rb") as f, gzip.open(tmp_path / "t.json.gz", "wb") as g:
        g.write(f.read())
    a, b = sim.load_trace(plain)[0], sim.load_trace(str(tmp_path / "t.json.gz"))[0]
    assert a["accepted"].tolist() == b["accepted"].tolist() == [2, 0]
    np.testing.assert_array_equal(a["pred_cum"], b["pred_cum"])


def test_informative_confidences_beat_every_fixed_length(tmp_path):
    """Half the events accept everything (predicted ~1), half nothing (predicted ~0): varlen
    verifies only the good rows and beats every fixed length; the async variant too."""
    K = 4
    pred = [[0.95] * K, [0.02] * K]
    obs = [[1] * K, [0] * K]
    trace = sim.load_trace(write_trace(tmp_path / "t.json", pred, obs))[0]
    out = sim.simulate(trace, linear(5.0, 0.2), 32, steps=60, rng=np.random.default_rng(1))
    best_fixed = max(out[f"fixed-{L}"]["tokens_per_s"] for L in range(1, K + 1))
    assert out["varlen"]["tokens_per_s"] > best_fixed
    assert out["varlen-async"]["tokens_per_s"] > best_fixed * 0.97
    assert out["varlen"]["vs_best_fixed"] > 1


def test_summary_trace_and_main(tmp_path):
    """A summary-only trace (as ``AcceptanceReport.summary()`` writes) runs in summary mode;
    main writes the table's JSON (and a PNG when matplotlib is present)."""
    res = dict(temperature=1.0, block_size=3, verifications=10, accepted_hist=[5, 3, 1, 1],
               mean_pred_cum=[0.6, 0.3, 0.1], mean_obs_cum=[0.5, 0.2, 0.1])
    path = tmp_path / "run" / "acc.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"meta": {}, "results": [res]}))
    tr = sim.load_trace(str(path))[0]
    assert sorted(tr["accepted"].tolist()) == [0] * 5 + [1] * 3 + [2, 3]
    assert tr["mode"].startswith("summary")
    assert np.allclose(tr["pred_cum"], [0.6, 0.3, 0.1])
    assert np.allclose(sim.load_trace(str(path), "obs")[0]["pred_cum"], [0.5, 0.2, 0.1])
    out_dir = tmp_path / "out"
    assert sim.main([str(path), "--sps-linear", "10", "0.05", "--seqs", "4", "16", "--steps", "5",
                     "--out-dir", str(out_dir)]) == 0
    j = json.loads((out_dir / "dspark_sim_run_linear_10ms_0.05ms.json").read_text())
    assert [r["seqs_per_rank"] for r in j["rows"]] == [4, 16]
    assert set(j["rows"][0]["strategies"]) == {"none", "fixed-1", "fixed-2", "fixed-3", "varlen", "varlen-async",
                                                 "varlen+plain"}
    assert "NOT reproduced" in j["meta"]["deepseek_note"]
    assert j["meta"]["curve"]["modelled"]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (out_dir / "dspark_sim_run_linear_10ms_0.05ms.png").stat().st_size > 0


def test_default_curve_is_labelled_modelled():
    c = json.loads(Path(sim.DEFAULT_CURVE).read_text())
    assert c["modelled"] is True and "MODELLED" in c["note"]
    est, name, meta = sim.load_curve(SimpleNamespace(sps_linear=None, sps=None))
    assert est.seconds(64) == pytest.approx((c["fixed_ms"] + 64 * c["per_token_ms"]) / 1e3, rel=1e-6)


@pytest.mark.parametrize("overhead_ms", [0.0, 8.0])
def test_plain_steps_keep_varlen_at_or_above_no_speculation(tmp_path, overhead_ms):
    """A verification step that costs ``overhead_ms`` more than a plain step, drafts or not
    (a small target, a launch-bound GPU): at 64 rows with modest acceptance every verifying
    strategy falls below no speculation, and varlen with plain steps does not (it runs plain
    steps, probing now and then). Without that overhead it matches varlen."""
    rng = np.random.default_rng(3)
    K, N = 4, 400
    c = rng.uniform(0.2, 0.6, size=(N, K))
    ok = rng.random((N, K)) < c
    obs = np.cumprod(ok, axis=1)
    trace = sim.load_trace(write_trace(tmp_path / "t.json", np.cumprod(c, axis=1), obs))[0]
    out = sim.simulate(trace, linear(10.0, 0.05), 64, steps=200, rng=np.random.default_rng(4),
                       verify_overhead_s=overhead_ms / 1e3)
    plain = out["varlen+plain"]
    if overhead_ms:
        assert out["varlen"]["vs_none"] < 0.9 and max(out[f"fixed-{L}"]["vs_none"] for L in range(1, K + 1)) < 0.9
        assert plain["vs_none"] > 0.97 and plain["plain_steps"] > 0.9
    else:
        assert plain["vs_none"] > 1.0 and plain["tokens_per_s"] == pytest.approx(out["varlen"]["tokens_per_s"], rel=0.03)
