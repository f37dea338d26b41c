#!/usr/bin/env python3
"""Where an engine's start-up goes: tracing, lowering and XLA compiling of its step variants.

Each configuration starts one ``LLM`` in a fresh process (so no in-memory jit cache is shared)
with ``jax.monitoring`` listeners on JAX's three compile phases (jaxpr trace, jaxpr -> MLIR,
backend compile). With ``--cache-dir`` every configuration is started twice against one
persistent compilation cache, cold then warm: the warm start is what a second server start
costs. The table gives, per configuration, the step variants, the compiles that took more than
a second (their count and the longest), each phase's total and the wall time of the start, and
("late") the compiles over a second that a short generate after the start still needed (a
warm-up that missed a jit cache key shows here); ``cache_events`` counts JAX's persistent-cache
events (``cache_hits``, ``cache_misses``, ...) of the start. Each configuration's cache is the
numbered subdirectory ``<cache-dir>/<i>``.

    python scripts/compile_profile.py --model v41-tiny --configs '{}' '{"kernels": "reference"}'
    python scripts/compile_profile.py --model v41-small-code --cache-dir /tmp/jaxcache \\
        --configs '{"kernels": "reference"}' '{}' '{"spec_decode": "dspark"}'
    python scripts/compile_profile.py --model v41-small-code \\
        --configs '{"compile_workers": 1}' '{"compile_workers": 8}'   # XLA compiles on 8 threads

Writes JSON (default ``benchmarks/results/compile_profile_<platform>.json``) with the device,
jax version and date.
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

PHASES = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
          "/jax/core/compile/backend_compile_duration": "backend_s"}


def child(model: str, config: dict, cache_dir: str | None, out_path: str) -> None:
    import jax

    if cache_dir:
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    events: list[tuple[str, float]] = []

    log = open(out_path + ".events", "a")  # read by the parent if this start runs out of time

    def on_duration(name: str, secs: float, **_kw) -> None:
        if name in PHASES:
            events.append((PHASES[name], float(secs)))
            log.write(json.dumps([PHASES[name], float(secs)]) + "\n")
            log.flush()

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    cache_events: dict[str, int] = {}  # JAX's persistent-cache counters (hits, misses, requests)

    def on_event(name: str, **_kw) -> None:
        if "compilation_cache" in name:
            key = name.rsplit("/", 1)[-1]
            cache_events[key] = cache_events.get(key, 0) + 1

    jax.monitoring.register_event_listener(on_event)
    from deepinfer_jax.entrypoints.llm import LLM
    from deepinfer_jax.runner.model_runner import compile_workers

    t0 = time.perf_counter()
    llm = LLM(model, progress=False, **config)
    start_s = time.perf_counter() - t0
    backend = [s for k, s in events if k == "backend_s"]
    # a short generate after the start must find every step compiled (none of its compiles
    # should be a step variant's: one over a second means warm-up missed a jit cache key)
    n0 = len(events)
    llm.generate([[5, 6, 7, 8]] * 3, _sampling(max_tokens=8), use_tqdm=False)
    late = [s for k, s in events[n0:] if k == "backend_s"]
    rec = {"config": config, "start_s": round(start_s, 2), "warmup_s": round(llm.compile_time_s, 2),
           "variants": len(llm.runner.variants()) * len(llm.runner.step_kinds()),
           "compile_workers": compile_workers(llm.engine.ec, len(llm.runner.variants()) * len(llm.runner.step_kinds())),
           "compiles_over_1s": sum(s > 1.0 for s in backend), "longest_compile_s": round(max(backend, default=0.0), 2),
           "generate_compiles_over_1s": sum(s > 1.0 for s in late)}
    for phase in PHASES.values():
        rec[phase] = round(sum(s for k, s in events if k == phase), 2)
    rec["cache_events"] = cache_events
    rec["device"] = jax.devices()[0].device_kind
    with open(out_path, "w") as f:
        json.dump(rec, f)


def _sampling(**kw):
    from deepinfer_jax.sampling.params import SamplingParams

    return SamplingParams(**kw)


def run_child(model: str, config: dict, cache_dir: str | None, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "rec.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(config), "--model", model, "--out", path]
        if cache_dir:
            cmd += ["--cache-dir", cache_dir]
        try:
            p = subprocess.run(cmd, timeout=timeout, capture_output=True, text=True)
        except subprocess.TimeoutExpired:
            rec = {"config": config, "error": f"timed out after {timeout:.0f} s"}
            if os.path.exists(path + ".events"):  # what it had compiled by then
                with open(path + ".events") as f:
                    ev = [json.loads(ln) for ln in f if ln.strip()]
                done = [s for k, s in ev if k == "backend_s"]
                rec["partial"] = {"compiles_over_1s": sum(s > 1.0 for s in done),
                                  "longest_compile_s": round(max(done, default=0.0), 2),
                                  **{ph: round(sum(s for k, s in ev if k == ph), 2) for ph in PHASES.values()}}
                rec["error"] += f"; by then {json.dumps(rec['partial'])}"
            return rec
        if p.returncode != 0 or not os.path.exists(path):
            return {"config": config, "error": (p.stderr or p.stdout).strip().splitlines()[-1:] or ["no output"]}
        with open(path) as f:
            return json.load(f)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="v41-tiny")
    ap.add_argument("--configs", nargs="+", default=['{"kernels": "reference"}', "{}"],
                    help="JSON objects of LLM keyword arguments, one engine start each")
    ap.add_argument("--cache-dir", default=None, help="persistent compilation cache: each start runs cold, then warm")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per start")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        child(args.model, json.loads(args.child), args.cache_dir, args.out)
        return 0
    try:
        configs = [json.loads(c) for c in args.configs]
    except json.JSONDecodeError as e:
        ap.error(f"--configs: not JSON ({e})")
    if not all(isinstance(c, dict) for c in configs):
        ap.error("--configs: each must be a JSON object of LLM keyword arguments")
    if args.cache_dir and os.path.isdir(args.cache_dir) and os.listdir(args.cache_dir):
        ap.error(f"--cache-dir {args.cache_dir}: not empty; the cold start needs an empty cache")
    rows = []
    for c in configs:
        runs = ["cold", "warm"] if args.cache_dir else ["cold"]
        for kind in runs:
            sub = os.path.join(args.cache_dir, str(len(rows) // len(runs))) if args.cache_dir else None
            rec = run_child(args.model, c, sub, args.timeout)
            rec["run"] = kind
            rows.append(rec)
            print(json.dumps(rec), flush=True)
    import jax

    hdr = f"{'config':<44} {'run':<5} {'variants':>8} {'start s':>8} {'trace s':>8} {'lower s':>8} {'XLA s':>8} {'>1s':>4} {'max s':>7} {'late':>5}"
    print("\n" + hdr + "\n" + "-" * len(hdr))
    for r in rows:
        if "error" in r:
            print(f"{json.dumps(r['config']):<44} {r['run']:<5} error: {r['error']}")
            continue
        print(f"{json.dumps(r['config']):<44} {r['run']:<5} {r['variants']:>8} {r['start_s']:>8.1f} {r['trace_s']:>8.1f} "
              f"{r['lower_s']:>8.1f} {r['backend_s']:>8.1f} {r['compiles_over_1s']:>4} {r['longest_compile_s']:>7.1f} {r['generate_compiles_over_1s']:>5}")
    out = args.out or f"benchmarks/results/compile_profile_{jax.default_backend()}.json"
    meta = {"model": args.model, "jax": jax.__version__, "platform": jax.default_backend(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "xla_flags": os.environ.get("XLA_FLAGS", "")}
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
