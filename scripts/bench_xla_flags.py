#!/usr/bin/env python3
"""The offline engine under several ``XLA_FLAGS`` settings: one ``bench_offline.py`` process each.

XLA reads its flags once per process, so each setting runs the whole ``scripts/bench_offline.py``
in a fresh process (same workload, same modes) and this script puts the results side by side:
generated tokens/s, step p50, the host's jitted-call time (on the launcher thread with
``dispatch_thread``: the kernel launches), and with ``--trace-idle`` the traced decode steps'
kernels per step, busy milliseconds and idle share. Every setting must produce the same output
tokens (their hash is compared); a setting that changes them is marked.

    python scripts/bench_xla_flags.py --flags= --flags=--xla_gpu_enable_command_buffer= \\
        --flags=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL \\
        -- --num-prompts 128 --input-len 128 --output-len 64 --modes async+thread --trace-idle async+thread \\
        --engine '{"max_num_seqs":128,"max_num_batched_tokens":256,"token_buckets":[128,256],"decoder_buckets":[256]}'

Each ``--flags=SETTING`` (with ``=``: a setting starts with dashes) is one run; ``--flags=`` is
the baseline (XLA's defaults). Arguments after ``--`` go to ``bench_offline.py`` (``--out`` is
this script's own). Writes JSON (default
``benchmarks/results/xla_flags_<platform>.json``) with each run's whole ``bench_offline`` JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def run_one(flags: str, bench_args: list[str], timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "offline.json")
        env = dict(os.environ, XLA_FLAGS=flags)
        t0 = time.perf_counter()
        try:
            p = subprocess.run([sys.executable, os.path.join(HERE, "bench_offline.py"), *bench_args, "--out", out],
                               env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"flags": flags, "error": f"timed out after {timeout:.0f} s"}
        wall = time.perf_counter() - t0
        if p.returncode != 0 or not os.path.exists(out):
            tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
            return {"flags": flags, "error": " | ".join(tail) or f"exit {p.returncode}"}
        with open(out) as f:
            return {"flags": flags, "wall_s": round(wall, 1), "offline": json.load(f)}


def rows_of(rec: dict) -> list[dict]:
    """One table row per mode of a run."""
    if "error" in rec:
        return [{"flags": rec["flags"], "error": rec["error"]}]
    off = rec["offline"]
    idle = off.get("decode_idle") or {}
    out = []
    for s in off["table"]:
        mode = s["mode"]
        row = {"flags": rec["flags"], "mode": mode, "gen_tok_s": s["generated_tokens_per_s"],
               "step_p50_ms": 1e3 * s["step_time_p50_s"],
               "call_ms": 1e3 * (s["launch_mean_s"] or s["host_breakdown_mean_s"]["call"]),
               "sha": s.get("output_tokens_sha256"), "compile_s": off.get("init_and_compile_s")}
        if idle and off["args"].get("trace_idle") == mode:
            row.update(kernels_per_step=idle.get("kernels"), busy_ms=idle.get("busy_ms"),
                       idle_fraction=idle.get("idle_fraction"))
        out.append(row)
    return out


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_args = []
    if "--" in argv:
        i = argv.index("--")
        argv, bench_args = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flags", action="append", required=True,
                    help="one XLA_FLAGS setting per --flags=SETTING (repeat it); --flags= is XLA's defaults")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if "--out" in bench_args:
        ap.error("--out after '--': this script writes the JSON (its own --out)")
    if os.environ.get("XLA_FLAGS"):
        print(f"note: XLA_FLAGS={os.environ['XLA_FLAGS']!r} in the environment is replaced by each setting")

    runs = []
    for flags in args.flags:
        rec = run_one(flags, bench_args, args.timeout)
        runs.append(rec)
        print(f"{flags or '(XLA defaults)'}: " + (rec["error"] if "error" in rec else f"done in {rec['wall_s']} s"),
              flush=True)
    rows = [r for rec in runs for r in rows_of(rec)]
    base_sha = next((r["sha"] for r in rows if r.get("sha")), None)
    print(f"\n{'XLA_FLAGS':60} {'mode':13} {'gen tok/s':>10} {'step p50 ms':>11} {'call ms':>8} "
          f"{'kernels':>8} {'busy ms':>8} {'idle':>6}  same tokens")
    for r in rows:
        name = (r["flags"] or "(defaults)")[:60]
        if "error" in r:
            print(f"{name:60} ERROR {r['error']}")
            continue
        k = r.get("kernels_per_step")
        print(f"{name:60} {r['mode']:13} {r['gen_tok_s']:10.1f} {r['step_p50_ms']:11.2f} {r['call_ms']:8.2f} "
              f"{k if k is not None else '':>8} {r.get('busy_ms') or 0:8.2f} "
              f"{(r.get('idle_fraction') or 0):6.1%}  {r['sha'] == base_sha}")
    import jax

    out = args.out or os.path.join("benchmarks", "results", f"xla_flags_{jax.default_backend()}.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "device": jax.devices()[0].device_kind, "jax": jax.__version__, "bench_args": bench_args,
                   "rows": rows, "runs": runs}, f, indent=1)
    print(f"wrote {out}")
    return 0 if all("error" not in r for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
