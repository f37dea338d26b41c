"""scripts/bench_host_path.py: the engine's host phases without a device. Its runner must drive
the real engine end to end (every request gets its tokens) and report decode-step phases; bad
arguments are refused by name."""

from __future__ import annotations

import json

import pytest

from conftest import load_script


def test_host_path_bench_runs_the_engine_and_reports_decode_phases(tmp_path, capsys):
    bench = load_script("bench_host_path")
    out = tmp_path / "host.json"
    assert bench.main(["--rows", "4", "16", "--input-len", "5", "--output-len", "6", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [(r["rows"], r["mode"]) for r in res["table"]] == [(4, "sync"), (4, "async"), (16, "sync"), (16, "async")]
    for r in res["table"]:
        # one prefill step, then a decode step per output token but the last (the prefill samples the first)
        assert r["decode_steps"] >= 4 and r["steps"] >= r["decode_steps"] + 1
        assert set(r["median_ms"]) == {"schedule", "inputs", "call", "process"}
        assert all(v > 0 for v in r["median_ms"].values()) and r["decode_total_ms"] > 0
    assert res["host"] and res["cores"] >= 1
    assert "rows mode" in capsys.readouterr().out


def test_host_path_bench_with_speculation(tmp_path):
    """DSpark rows (fixed and varlen) through the real engine: every request still gets its
    tokens, verification rows carry drafts and about accept-rate tokens pass."""
    bench = load_script("bench_host_path")
    out = tmp_path / "spec.json"
    assert bench.main(["--rows", "8", "--input-len", "4", "--output-len", "12", "--spec", "fixed,varlen",
                       "--modes", "async", "--accept", "1.0", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    fixed, varlen = res["table"]
    assert (fixed["spec"], varlen["spec"]) == ("fixed", "varlen")
    assert fixed["drafts_per_row"] > 3 and fixed["mean_accepted_length"] > 3  # every draft passes
    assert 0 < varlen["drafts_per_row"] <= fixed["drafts_per_row"]


@pytest.mark.parametrize("args, match", [(["--rows", "0"], "--rows"), (["--modes", "fast"], "--modes"),
                                         (["--spec", "eagle"], "--spec"), (["--accept", "2"], "--accept")])
def test_host_path_bench_refuses_bad_arguments(args, match, capsys):
    bench = load_script("bench_host_path")
    with pytest.raises(SystemExit):
        bench.main(args)
    assert match in capsys.readouterr().err
