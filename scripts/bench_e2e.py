#!/usr/bin/env python3
"""The model's forward step with the Pallas kernels on vs off (pure-jnp references), at a
per-GPU slice of DeepSeek-V4.1-Flash: real widths (D=5120, 64 heads x 512, index 32 x 128,
top-512, window 128, F=2304), the tiny model's 6-layer schedule (window, ratio-2 and ratio-1
layers, KV/index/candidate sources, Engram; or, ``--depth full``, the released 40 + 3), a few
local experts and small Engram tables.

Decode: ``--decode-requests`` rows of ``--decode-tokens`` tokens each (1; or 1 + drafts, a
verification step, logits at every token) ending at position ``--context - 1`` (caches filled
with random values: the work per step is what is timed, not the text). ``--depth full`` has 7
local experts by default (DeepInfer's EP64 decode rank: 6 routed + 1 redundant). Prefill: one
row of ``--prefill-tokens`` fresh tokens. Each case is compiled once per backend, then timed as the
median of ``--iters`` steps; the table gives the kernels-on/off ratio measured in the same run.
``--backends auto,auto-without=sinkhorn_iterate+f32_matmul`` measures what given kernels add;
``--compile-cache DIR`` adds each step's compile time from a warm persistent compilation cache;
``--profile N`` traces N more steps: device time per kernel family and device idle.

    python scripts/bench_e2e.py                         # on the GPU; writes benchmarks/results/e2e_<device>.json
    python scripts/bench_e2e.py --small --context 256 --prefill-tokens 64 --decode-requests 4   # CPU smoke run
    python scripts/bench_e2e.py --backends auto,auto-without=f32_matmul --compile-cache /tmp/jaxcache
    python scripts/bench_e2e.py --depth full --backends auto --cases decode --decode-requests 256 --decode-tokens 4 --context 32768

Routing: every token picks ``num_experts_per_tok`` of the ``--experts`` local experts, so a step
routes more rows per expert than a real EP rank (which sees about T*6/48 rows for 8 of 384
experts); the MoE share of the time is therefore an upper bound.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # step_floor

from step_floor import StepShape, params_of, step_floor  # noqa: E402
from step_profile import profile_steps  # noqa: E402
from kernel_bench import back_to_back_time, copy_rate  # noqa: E402


TAU = 3.25  # DeepSeek's mean accepted length in their decode throughput formula


def measure_rates(on_gpu: bool) -> dict:
    """Copy bandwidth (``kernel_bench.copy_rate``: 2 GiB, bytes read + written) and the dense
    bf16 GEMM rate (8192^3; 1024^3 on the CPU), the floors' denominators."""
    import jax
    import jax.numpy as jnp

    _, copy_bps = copy_rate((1 << 30) if on_gpu else (1 << 22), iters=5)
    m = 8192 if on_gpu else 1024
    x = jnp.ones((m, m), jnp.bfloat16)
    gemm = jax.jit(lambda p, q: jnp.matmul(p, q, preferred_element_type=jnp.float32))
    return dict(copy_gbps=copy_bps / 1e9, gemm_tflops=2 * m ** 3 / back_to_back_time(gemm, (x, x), iters=5) / 1e12)


def fill_random(cache, seed: int):
    """Random cache contents: normal values (x 0.5) in float arrays (-inf state entries kept),
    random bytes in packed codes, scale bytes near 2^0 in packed window scales."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    key = jax.random.key(seed)
    out = {}
    for f in dataclasses.fields(cache):
        arrs = []
        for x in getattr(cache, f.name):
            key, k = jax.random.split(key)
            if x.dtype == jnp.uint8:
                lo, hi = (124, 131) if f.name == "window_scale" else (0, 256)
                arrs.append(jax.random.randint(k, x.shape, lo, hi, jnp.int32).astype(jnp.uint8))
            else:
                arrs.append(jnp.where(jnp.isfinite(x), (jax.random.normal(k, x.shape, jnp.float32) * 0.5).astype(x.dtype), x))
        out[f.name] = tuple(arrs)
    return type(cache)(**out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="tiny widths (CPU smoke run)")
    ap.add_argument("--experts", type=int, default=None,
                    help="local routed experts per layer (default 8; with --depth full 7: DeepInfer's EP64 "
                         "decode rank, 6 routed + 1 redundant)")
    ap.add_argument("--depth", choices=("tiny", "full"), default="tiny",
                    help="layer schedule: the tiny model's 6 + 2 layers, or the released 40 + 3")
    ap.add_argument("--context", type=int, default=4096, help="decode position + 1")
    ap.add_argument("--decode-requests", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=1,
                    help="tokens per decode row (1 + drafts: 4 is a verification step of 3 drafts)")
    ap.add_argument("--prefill-tokens", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--cases", default="decode,prefill", help="comma-separated subset of decode,prefill")
    ap.add_argument("--model-dir", default=None,
                    help="load this checkpoint instead of drawing random weights on the device")
    ap.add_argument("--backends", default="reference,auto",
                    help="comma-separated: reference, auto, or auto-without=OP+OP (the kernels on but "
                         "those ops on their references; names from kernels_pallas.ops.OPS)")
    ap.add_argument("--compile-cache", default=None, metavar="DIR",
                    help="JAX's persistent compilation cache in DIR; each case is then compiled a "
                         "second time after jax.clear_caches() (warm_compile_s: a restart's compile)")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="trace STEPS more steps per case with jax.profiler: device time per kernel family, "
                         "the busiest kernels, device idle (scripts/step_profile.py)")
    ap.add_argument("--kv-cache-dtype", choices=("bf16", "packed"), default="bf16",
                    help="window + compressed KV caches (packed: fp8 / fp4 codes, decoded in the attention kernel)")
    ap.add_argument("--index-key-dtype", choices=("bf16", "fp8"), default="bf16", help="index-key cache")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    # XLA_FLAGS of the run go into the JSON (command-buffer experiments set them per process)
    args.xla_flags = os.environ.get("XLA_FLAGS", "")

    import jax
    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # every entry, whatever its size
    import numpy as np
    from flax import nnx

    from deepinfer_jax.kernels_pallas import ops
    from deepinfer_jax.models.cache import CacheConfig, allocate_cache, default_block_tokens
    from deepinfer_jax.runner.engram_hash import EngramHasher
    from deepinfer_jax.base.forward_batch import RowSpec, build_batch
    from deepinfer_jax.checkpoint.random_checkpoint import write_random_model_config
    from deepinfer_jax.models.model_slice import slice_config
    from deepinfer_jax.models.random_weights import random_model_on_device
    from deepinfer_jax.models.weights import load_model

    t0 = time.perf_counter()
    if args.model_dir:
        model_dir = args.model_dir
        model = load_model(model_dir, progress=True)
    else:  # tokenizer + config on disk (the Engram hasher needs them), weights drawn on the device
        model_dir = tempfile.mkdtemp(prefix="v41_slice_")
        experts = args.experts or (7 if args.depth == "full" else 8)
        cfg = write_random_model_config(slice_config(args.small, experts, args.context, args.depth), model_dir)
        model = random_model_on_device(cfg, seed=0)
    cfg = model.cfg
    print(f"model ready in {time.perf_counter() - t0:.1f}s ({model_dir})", flush=True)
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    tok = os.path.join(model_dir, "tokenizer.json")
    hasher = EngramHasher.from_model_config(cfg, tok if os.path.exists(tok) else None) if cfg.engram_enabled else None

    bt = default_block_tokens(cfg)
    R = max(args.decode_requests, 1)
    if not 1 <= args.decode_tokens <= args.context:
        raise SystemExit(f"--decode-tokens {args.decode_tokens}: expected 1 .. --context ({args.context})")
    per_seq = -(-max(args.context, args.prefill_tokens) // bt)
    cc = CacheConfig(num_slots=R, num_blocks=R * per_seq, block_tokens=bt, max_blocks_per_seq=per_seq,
                     kv_cache_dtype=args.kv_cache_dtype, index_key_dtype=args.index_key_dtype)
    rng = np.random.default_rng(0)

    k = args.decode_tokens

    def rows_decode():  # k tokens a row ending at position context - 1 (k > 1: a verification row)
        out = []
        for r in range(R):
            hist = rng.integers(3, cfg.vocab_size, size=args.context)
            e = hasher.hash_positions(hist, np.arange(args.context - k, args.context)) if hasher else None
            out.append(RowSpec(hist[-k:].tolist(), args.context - k, r, list(range(r * per_seq, (r + 1) * per_seq)), e))
        return out

    def rows_prefill():
        toks = rng.integers(3, cfg.vocab_size, size=args.prefill_tokens)
        e = hasher.hash_positions(toks, np.arange(len(toks))) if hasher else None
        return [RowSpec(toks.tolist(), 0, 0, list(range(per_seq)), e)]

    def batch_of(rows, T, logits="last"):
        return build_batch(rows, num_tokens=T, num_rows=len(rows), max_blocks=per_seq, num_slots=R,
                           n_engram_layers=hasher.n_layers if hasher else 0,
                           n_hash_cols=hasher.n_hash_cols if hasher else 0, logits=logits)

    # verification rows need logits at every token (the head runs on R * k rows)
    makers = {"decode": lambda: batch_of(rows_decode(), R * k, "all" if k > 1 else "last"),
              "prefill": lambda: batch_of(rows_prefill(), args.prefill_tokens)}
    wanted = [c for c in args.cases.split(",") if c]
    if not wanted or any(c not in makers for c in wanted):
        raise SystemExit(f"--cases {args.cases!r}: expected a comma-separated subset of {tuple(makers)}")
    cases = {c: makers[c]() for c in wanted}
    # the floors (step_floor.py) and the rates they are divided by, measured in this run
    rates = measure_rates(jax.default_backend() == "gpu")
    print(f"copy {rates['copy_gbps']:.0f} GB/s (read + write), dense bf16 GEMM {rates['gemm_tflops']:.1f} TFLOP/s",
          flush=True)
    params = params_of(cfg)
    shapes = {"decode": StepShape(rows=R, tokens=k, end=args.context, logit_rows=R * k,
                                  **StepShape.cache_bytes(args.kv_cache_dtype, args.index_key_dtype, cfg.index_head_dim)),
              "prefill": StepShape(rows=1, tokens=args.prefill_tokens, end=args.prefill_tokens, logit_rows=1,
                                   prefill=True)}
    floors = {c: step_floor(cfg, params, shapes[c]) for c in cases}
    device = jax.devices()[0].device_kind
    out = args.out or os.path.join("benchmarks", "results", f"e2e_{device.replace(' ', '_')}.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)

    def save():  # after every row too: a run cut short by a time limit keeps what it measured
        with open(out, "w") as f:
            json.dump({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "device": device, "jax": jax.__version__, "args": vars(args),
                       "rates": rates, "config": cfg.to_hf_dict(), "table": table}, f, indent=1, default=str)

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    for b in backends:
        if b not in ("reference", "auto") and not b.startswith("auto-without="):
            raise SystemExit(f"--backends: {b!r}: expected reference, auto or auto-without=OP+OP")
    table = []
    for backend in backends:
        ops.set_backend("reference" if backend == "reference" else "auto")
        ops.set_disabled(backend.partition("=")[2].split("+") if "=" in backend else ())

        def fwd(leaves_, cache_, batch_):  # a new function per backend: ops choose at trace time
            m = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves_))
            return m(cache_, batch_)[:2]

        step = jax.jit(fwd, donate_argnums=(1,))
        for case, batch in cases.items():
            cache = fill_random(allocate_cache(cfg, cc), 1)
            t_c = time.perf_counter()
            cache, lg = step(leaves, cache, batch)
            jax.block_until_ready(lg)
            compile_s = time.perf_counter() - t_c
            times, dispatch = [], []
            for _ in range(args.iters):
                t = time.perf_counter()
                cache, lg = step(leaves, cache, batch)
                dispatch.append(time.perf_counter() - t)  # the host's share: the call returns once launched
                jax.block_until_ready(lg)
                times.append(time.perf_counter() - t)
            row = {"case": case, "backend": backend, "tokens": int(batch.num_tokens),
                   "median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times),
                   "dispatch_ms": 1e3 * statistics.median(dispatch),
                   "compile_s": compile_s, "finite": bool(np.isfinite(np.asarray(lg)).all()),
                   "logit_rows": int(np.prod(lg.shape[:-1]))}
            fl = floors[case]
            byte_ms = 1e3 * fl["bytes"] / (rates["copy_gbps"] * 1e9)
            flop_ms = 1e3 * fl["flops"] / (rates["gemm_tflops"] * 1e12)
            row.update(floor_bytes=fl["bytes"], floor_flops=fl["flops"], floor_parts=fl["parts"],
                       byte_floor_ms=byte_ms, flop_floor_ms=flop_ms,
                       of_floor=max(byte_ms, flop_ms) / row["median_ms"],
                       mfu=fl["flops"] / (row["median_ms"] * 1e-3) / (rates["gemm_tflops"] * 1e12))
            if case == "decode":  # DeepSeek's formula: steps/s x requests x tau
                row["deepseek_tokens_per_s"] = 1e3 / row["median_ms"] * R * TAU
            prof_line = None
            if args.profile:
                state = {"cache": cache}

                def one_step():
                    state["cache"], out = step(leaves, state["cache"], batch)
                    return out

                row["profile"] = profile_steps(one_step, args.profile)
                cache = state["cache"]
                p = row["profile"]
                fams = ", ".join(f"{f} {t:.2f}" for f, t in p["families"].items())
                idle = f"{p['idle_fraction']:.1%}" if p["idle_fraction"] is not None else "-"
                prof_line = (f"         profile: {p['kernels']} kernels a step, busy {p['busy_ms']:.2f} ms, "
                             f"idle {idle}; ms a step: {fams}")
            # loops left in the step's program (each XLA while loop runs its body as separate launches)
            row["while_loops"] = step.lower(leaves, cache, batch).as_text().count("stablehlo.while")
            if args.compile_cache:  # trace, lower and load from the disk cache, as a restarted process would
                # entries written so far: a warm compile as slow as the cold one with entries here
                # is a cache miss or work the cache does not hold (kernels compiled at load)
                row["cache_entries"] = len(os.listdir(args.compile_cache)) if os.path.isdir(args.compile_cache) else 0
                jax.clear_caches()
                t_c = time.perf_counter()
                cache, lg = step(leaves, cache, batch)
                jax.block_until_ready(lg)
                row["warm_compile_s"] = time.perf_counter() - t_c
            table.append(row)
            save()
            warm = f", warm {row['warm_compile_s']:.1f}s" if "warm_compile_s" in row else ""
            print(f"{case:8} {backend:9} {row['tokens']:6d} tok  median {row['median_ms']:9.2f} ms  "
                  f"min {row['min_ms']:9.2f} ms  dispatch {row['dispatch_ms']:7.2f} ms  (compile {compile_s:.1f}s{warm}, finite logits {row['finite']}, "
                  f"{row['while_loops']} while loops)",
                  flush=True)
            print(f"         floor: {fl['bytes'] / 1e9:.3g} GB -> {byte_ms:.2f} ms, {fl['flops'] / 1e12:.3g} TFLOP -> "
                  f"{flop_ms:.2f} ms; step at {row['of_floor']:.0%} of the floor, MFU {row['mfu']:.0%}"
                  + (f", {row['deepseek_tokens_per_s']:.0f} tok/s by DeepSeek's formula (tau {TAU})"
                     if case == "decode" else ""), flush=True)
            if prof_line:
                print(prof_line, flush=True)
    ops.set_disabled(())
    for case in cases:
        ref = next((r for r in table if r["case"] == case and r["backend"] == "reference"), None)
        for ker in (r for r in table if r["case"] == case and r["backend"] != "reference"):
            if ref is not None:
                ker["speedup_vs_reference"] = ref["median_ms"] / ker["median_ms"]
                print(f"{case}: {ker['backend']} / reference = {ker['speedup_vs_reference']:.2f}x faster")
    save()
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
