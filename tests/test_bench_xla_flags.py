"""``scripts/bench_xla_flags.py`` on CPU: one bench_offline process per XLA_FLAGS setting."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_xla_flags", REPO / "scripts" / "bench_xla_flags.py")
bxf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bxf)

WORKLOAD = ["--", "--model", "v41-tiny", "--num-prompts", "4", "--input-len", "16", "--output-len", "4",
            "--modes", "sync", "--engine", '{"max_num_seqs": 4, "max_num_batched_tokens": 32}']


def test_settings_side_by_side_and_a_bad_flag_reported(tmp_path, capsys):
    out = tmp_path / "flags.json"
    rc = bxf.main(["--flags=", "--flags=--xla_cpu_use_thunk_runtime=true", "--flags=--xla_no_such_flag=1",
                   "--out", str(out)] + WORKLOAD)
    assert rc == 1  # the bad setting failed
    j = json.loads(out.read_text())
    ok = [r for r in j["rows"] if "error" not in r]
    assert [r["flags"] for r in ok] == ["", "--xla_cpu_use_thunk_runtime=true"]
    assert all(r["mode"] == "sync" and r["gen_tok_s"] > 0 and r["step_p50_ms"] > 0 for r in ok)
    assert ok[0]["sha"] == ok[1]["sha"]  # the same tokens under both settings
    (bad,) = [r for r in j["rows"] if "error" in r]
    assert bad["flags"] == "--xla_no_such_flag=1"
    table = capsys.readouterr().out
    assert "(defaults)" in table and "ERROR" in table
