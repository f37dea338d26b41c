#!/usr/bin/env python3
"""Offline throughput of ``LLM.generate`` on a synthetic workload, async vs sync scheduling.

Builds one engine (weights, cache, compiled buckets), runs an untimed warm-up generate, then the
same workload once per scheduling mode on the same runner, and prints a table with each mode's
throughput and step-time statistics and its ratio to the synchronous loop measured in this run.
Writes the table, the engine config, the device and per-step stats to JSON.

    python scripts/bench_offline.py                       # v41-tiny random weights, this machine
    python scripts/bench_offline.py --num-prompts 128 --input-len 256 --output-len 64 \\
        --engine '{"max_num_batched_tokens": 512}' --out benchmarks/results/offline_gpu.json

Modes (``--modes``, comma-separated): ``async`` and ``sync`` scheduling, each optionally with
``+thread`` (``EngineConfig.dispatch_thread``: the jitted calls on the runner's launcher thread;
the "call" column is then the hand-over, and the launcher's own call time is in parentheses).
The table's last line says whether every mode produced the same tokens.

``--trace-idle MODE`` (e.g. ``async+thread``) then runs the workload once more in that mode, with
twice the output tokens, and traces ``--trace-steps`` steps once no prompt token is left
(decode only) with ``jax.profiler``: the device's idle fraction over them, the traced span less
the union of its kernels (``scripts/step_profile.py``), written to the JSON as ``decode_idle``.
The profiler's own host work makes this an upper bound of the untraced idle time.

Random weights: the tokens are meaningless, the work per token is the real model's.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def workload(n: int, input_len: int, output_len: int, spread: float, shared_prefix: int, vocab: int, seed: int):
    import numpy as np

    rng = np.random.default_rng(seed)
    shared = rng.integers(3, vocab, size=shared_prefix).tolist()
    lo, hi = max(1, int(input_len * (1 - spread))), max(1, int(input_len * (1 + spread)))
    prompts = [shared + rng.integers(3, vocab, size=int(rng.integers(lo, hi + 1))).tolist() for _ in range(n)]
    return prompts


def traced_decode_idle(engine, prompts, sp, steps: int) -> dict:
    """Run ``prompts`` on ``engine`` step by step; once a processed step had no prompt token and
    nothing waits, trace the next ``steps`` steps with ``jax.profiler`` and return
    ``step_profile.breakdown`` of their kernels (plus the rows of the first and last traced
    step); the rest of the run finishes untraced."""
    import step_profile

    events, traced = step_profile.trace_engine_decode(engine, prompts, sp, steps, prefix="bench_offline_trace")
    if not events:
        return dict(step_profile.breakdown([], steps=0), rows_first=None, rows_last=None)
    out = step_profile.breakdown(events, steps=len(traced))
    out.update(rows_first=traced[0].num_rows, rows_last=traced[-1].num_rows,
               prefill_tokens=sum(s.num_prefill_tokens for s in traced))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="v41-tiny")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--input-spread", type=float, default=0.5, help="prompt lengths uniform in len*(1±spread)")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--shared-prefix", type=int, default=0, help="tokens of a prefix shared by every prompt")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--engine", default="{}", help="JSON of EngineConfig fields")
    ap.add_argument("--modes", default="async,sync")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace-idle", default=None, metavar="MODE",
                    help="trace decode-only steps in this mode and report the device's idle fraction")
    ap.add_argument("--trace-steps", type=int, default=20)
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/offline_<platform>.json)")
    args = ap.parse_args(argv)

    import jax

    from deepinfer_jax import LLM, SamplingParams
    from deepinfer_jax.engine.llm_engine import LLMEngine

    engine_kw = dict(max_num_seqs=32, max_num_batched_tokens=256)
    engine_kw.update(json.loads(args.engine))
    t0 = time.perf_counter()
    llm = LLM(args.model, progress=False, **engine_kw)
    init_s = time.perf_counter() - t0
    ec = llm.engine_config
    prompts = workload(args.num_prompts, args.input_len, args.output_len, args.input_spread, args.shared_prefix,
                       llm.model_config.vocab_size, args.seed)
    sp = SamplingParams(temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True, seed=args.seed)
    llm.generate(prompts[: min(4, len(prompts))], sp, use_tqdm=False)  # warm-up (untimed)

    from deepinfer_jax.runner.step_launcher import StepLauncher

    def use_mode(mode: str, flag: str = "--modes") -> None:
        sched_mode, _, thread = mode.partition("+")
        if sched_mode not in ("async", "sync") or thread not in ("", "thread"):
            raise SystemExit(f"{flag}: {mode!r}: expected async or sync, optionally +thread")
        # +thread: the jitted calls on the runner's launcher thread (EngineConfig.dispatch_thread)
        llm.runner.drain()
        llm.runner.launcher = StepLauncher() if thread else None
        llm.engine = LLMEngine(llm.runner, dataclasses.replace(ec, async_scheduling=(sched_mode == "async"),
                                                               dispatch_thread=bool(thread)),
                               llm.tokenizer, llm.model_config.eos_token_id)

    if args.trace_idle is not None:
        use_mode(args.trace_idle, "--trace-idle")  # checked before the timed runs
    rows, per_mode = [], {}
    for mode in args.modes.split(","):
        use_mode(mode)
        outs = llm.generate(prompts, sp, use_tqdm=False)
        s = llm.stats.summary()
        s["mode"] = mode
        s["output_tokens_check"] = sum(len(o.outputs[0].token_ids) for o in outs)
        s["output_tokens_sha256"] = hashlib.sha256(repr([o.outputs[0].token_ids for o in outs]).encode()).hexdigest()
        rows.append(s)
        per_mode[mode] = {"summary": s, "steps": [dataclasses.asdict(x) for x in llm.stats.steps]}
    base = next((r for r in rows if r["mode"] == "sync"), rows[0])
    same = all(r["output_tokens_sha256"] == rows[0]["output_tokens_sha256"] for r in rows)
    hdr = f"{'mode':12} {'gen tok/s':>10} {'tok/s':>9} {'vs sync':>8} {'steps':>6} {'step p50 ms':>12} " \
          f"{'step p90 ms':>12} {'host ms/step':>13} {'wall s':>7} {'pad %':>6}   " \
          "host ms: plan / inputs / call / results (launch thread)"
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), model {llm.model_dir}")
    print(f"workload: {args.num_prompts} prompts x ~{args.input_len} tokens (+{args.shared_prefix} shared), "
          f"{args.output_len} output tokens; buckets {ec.token_buckets}, max_num_seqs {ec.max_num_seqs}; "
          f"init+compile {init_s:.1f}s")
    print(hdr)
    for r in rows:
        print(f"{r['mode']:12} {r['generated_tokens_per_s']:10.1f} {r['total_tokens_per_s']:9.1f} "
              f"{r['generated_tokens_per_s'] / base['generated_tokens_per_s']:8.2f} {r['steps']:6d} "
              f"{1e3 * r['step_time_p50_s']:12.2f} {1e3 * r['step_time_p90_s']:12.2f} "
              f"{1e3 * r['host_time_mean_s']:13.2f} {r['wall_time_s']:7.2f} {100 * r['padding_fraction']:6.1f}   "
              + " / ".join(f"{1e3 * v:.2f}" for v in r["host_breakdown_mean_s"].values())
              + (f" ({1e3 * r['launch_mean_s']:.2f})" if r["launch_mean_s"] else ""))
    print(f"same output tokens in every mode: {same}")
    idle = None
    if args.trace_idle is not None:
        use_mode(args.trace_idle, "--trace-idle")
        sp2 = SamplingParams(temperature=args.temperature, max_tokens=2 * args.output_len, ignore_eos=True,
                             seed=args.seed)
        idle = traced_decode_idle(llm.engine, prompts, sp2, args.trace_steps)
        print(f"{args.trace_idle}: device idle {100 * idle['idle_fraction']:.1f}% of {idle['steps']} traced "
              f"decode-only steps ({idle['rows_first']}-{idle['rows_last']} rows; span {idle['span_ms']:.2f} ms, "
              f"kernels busy {idle['busy_ms']:.2f} ms per step)" if idle["idle_fraction"] is not None
              else f"{args.trace_idle}: no decode-only step to trace")
    out = args.out or os.path.join("benchmarks", "results", f"offline_{jax.default_backend()}.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump({
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": jax.devices()[0].device_kind, "platform": jax.default_backend(),
            "jax": jax.__version__, "model": llm.model_dir, "args": vars(args),
            "engine_config": {k: v for k, v in dataclasses.asdict(ec).items()},
            "init_and_compile_s": init_s, "compile_s": llm.compile_time_s,
            "table": rows, "per_mode": per_mode, "decode_idle": idle,
        }, f, indent=1, default=str)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
