"""scripts/bench_spec.py ``--slice``: a random-weight V4.1-Flash slice (here its tiny widths,
``--small``) runs through the real engines with weights drawn on the device, forced acceptance
0.75 by default, and the JSON names the slice; bad combinations are refused by flag."""

from __future__ import annotations

import json
import os
import tempfile

import pytest

from conftest import load_script


def test_slice_smoke_run_writes_throughput_and_slice(tmp_path, monkeypatch, capsys):
    bench = load_script("bench_spec")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the slice's directory goes here
    out = tmp_path / "spec.json"
    # one token bucket (4 x C = (K+1) x C) and no plain steps: one compiled variant per engine
    assert bench.main(["--slice", "tiny", "--small", "--concurrency", "2", "--modes", "none,fixed1,fixed",
                       "--input-len", "8", "--output-len", "14", "--repeats", "1", "--prefill-chunk", "1",
                       "--requests-per-slot", "2", "--trace-steps", "2",
                       "--bucket-multiples", "4", "--engine", '{"spec_plain_steps": false}',
                       "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["force_accept"] == 0.75 and res["args"]["force_accept"] == 0.75
    sl = res["slice"]
    assert (sl["depth"], sl["widths"], sl["layers"], sl["nextn_layers"], sl["experts"]) == ("tiny", "tiny", 6, 2, 8)
    assert sl["force_accept"] == 0.75 and sl["load_format"] == "dummy"
    assert res["model"] == "v41-flash-slice-tiny-small"
    assert os.path.dirname(sl["dir"]) == str(tmp_path)  # config and tokenizer only: no weights on disk
    assert sorted(os.listdir(sl["dir"])) == ["config.json", "tokenizer.json", "tokenizer_config.json"]
    rows = {r["mode"]: r for r in res["rows"]}
    assert set(rows) == {"none", "fixed1", "fixed"}
    # fixed1: one draft a row on the engine compiled for K (its rows verify 1, the full K more)
    assert rows["fixed1"]["drafts_per_row"] <= 1 < rows["fixed"]["drafts_per_row"]
    for r in rows.values():
        # a wave: 2 requests per slot, 2 slots, 14 tokens each; the headline is the full-batch window
        assert r["concurrency"] == 2 and r["requests_per_slot"] == 2 and r["output_tokens"] == 2 * 2 * 14
        assert r["full_batch_rows"] == 2 and r["full_batch_generated_tokens_per_s"] > 0
        # --trace-steps: the kernels of 2 traced decode steps of the 2 requests (14 tokens leave
        # room for them after the ramp at any acceptance; a CPU's XLA thunks here)
        assert r["decode_trace"]["steps"] == 2 and r["decode_trace"]["kernels"] > 0
        assert r["decode_trace"]["prefill_tokens"] == 0  # decode steps only
    assert rows["fixed"]["spec_rows"] > 0 and rows["fixed1"]["spec_rows"] > 0 and rows["none"]["spec_rows"] == 0
    assert "FORCED acceptance 0.75" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--slice", "tiny", "--model", "v41-tiny"], "--model and --slice: give one"),
    (["--small"], "--small and --experts shape a --slice"),
    (["--experts", "4"], "--small and --experts shape a --slice"),
    (["--slice", "full", "--experts", "0"], "--experts: 0 must be >= 1"),
    (["--slice", "half"], "argument --slice: invalid choice: 'half'"),
    (["--requests-per-slot", "0"], "--requests-per-slot: 0 must be >= 1"),
    (["--modes", "none,fast"], "--modes: 'fast' is not one of none, fixed, fixed1..fixedK, varlen"),
    (["--modes", "fixed0"], "--modes: 'fixed0' is not one of"),
    (["--modes", "fixed9"], "--modes: 'fixed9' is not one of none, fixed, fixed1..fixed5, varlen (K = 5)"),
])
def test_slice_flags_refused_by_name(argv, message, capsys):
    bench = load_script("bench_spec")
    with pytest.raises(SystemExit) as ei:
        bench.main(argv)
    assert ei.value.code == 2
    assert message in capsys.readouterr().err
