#!/usr/bin/env python3
"""How long an engine's GPU step programs take to trace and lower, measured on any host.

Lowering (jaxpr -> MLIR, Pallas kernels included) runs in Python before XLA compiles anything,
and a persistent compilation cache cannot skip it (its key is the lowered module). This script
builds an engine without compiling (``precompile=False``), then traces and lowers its step
variants for CUDA with the GPU kernels chosen, on this machine, without a GPU: JAX is told the
default backend is ``gpu`` and the target an SM90 device (an H200) while the steps are traced.
Nothing is compiled or run. Per variant it prints the trace and lowering seconds and the Pallas
launch sites in the module (Triton and Mosaic GPU custom calls); ``--top N`` adds the N most
expensive functions of the lowering (cProfile, cumulative); ``--census N`` the N functions of
this package that emit the most operations that start a GPU kernel or end a fusion (``op_census``: where a
launch-bound step's kernels come from, roughly).

    python scripts/gpu_lowering_profile.py --model v41-small-code
    python scripts/gpu_lowering_profile.py --model v41-small-code --engine '{"spec_decode": "dspark"}' --top 25

A kernel whose lowering repeats per layer shows here as launch sites growing with the depth
(``kernels_pallas/moe_gmm.moe_experts`` is jitted for that reason). The patches touch JAX
internals (JAX's GPU description, ``kernels_pallas/sm90_target.py``) that move between releases; on a real GPU
use ``scripts/compile_profile.py``, which times the whole start.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import re
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


@contextlib.contextmanager
def as_if_on_an_h200():
    """Kernel choice and Pallas lowering as on an SM90 GPU (see the module docstring)."""
    import jax

    from deepinfer_jax.kernels_pallas import moe_gmm
    from deepinfer_jax.kernels_pallas.sm90_target import lowering_as_sm90

    saved = (jax.default_backend, moe_gmm.is_hopper)
    jax.default_backend = lambda: "gpu"
    moe_gmm.is_hopper = lambda: True
    try:
        with lowering_as_sm90():
            yield
    finally:
        jax.default_backend, moe_gmm.is_hopper = saved


def lower_variant(runner, T: int, R: int, Td: int | None):
    """(trace s, lower s, module text, closed jaxpr) of one step variant, lowered for CUDA: the runner's own
    step and arguments (``ModelRunner.step_inputs`` / ``step_call``) on a padding-only step."""
    import jax

    from deepinfer_jax.base.scheduler_output import SchedulerOutput

    empty = SchedulerOutput(step_id=-1, rows=[], preempted=[], cache_hit_tokens=0, queue_wait=[])
    fn, args, kw = runner.step_call(*runner.step_inputs(empty, T, R, Td), prompt_lp=False)
    t0 = time.perf_counter()
    with jax.set_mesh(runner.trace_mesh):
        traced = fn.trace(*args, **kw)
        t1 = time.perf_counter()
        lowered = traced.lower(lowering_platforms=("cuda",))
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, lowered.as_text(), traced.jaxpr


# primitives that start a kernel of their own or end a fusion on the GPU (XLA fuses elementwise
# ops, slices, concatenations, transposes and most gathers into their neighbours)
_KERNEL_STARTERS = frozenset(
    "reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor argmax argmin "
    "dot_general ragged_dot pallas_call custom_call scatter scatter-add scatter_add scatter_mul scatter_min "
    "scatter_max sort top_k cumsum cumprod cummax cummin cumlogsumexp dynamic_update_slice "
    "optimization_barrier while cond random_bits threefry2x32 fft".split())
_TRANSPARENT = frozenset(("jit", "pjit", "closed_call", "custom_jvp_call", "custom_vjp_call", "remat", "checkpoint"))


def op_census(closed_jaxpr) -> dict:
    """Operations of a traced step per function of this package that emitted them (the innermost
    ``deepinfer_jax`` frame): ``{function: [all ops, kernel-starting ops]}`` (``_KERNEL_STARTERS``). Nested jits
    are walked through, a Pallas kernel counts as one op, a scan body counts ``length`` times. A
    proxy for where the GPU step's kernels come from (XLA's fusion decides the real count)."""
    from jax.extend import core as jcore

    counts: dict[str, list[int]] = {}

    def where(eqn) -> str:
        tb = eqn.source_info.traceback
        for f in (tb.frames if tb is not None else ()):
            if "deepinfer_jax/" in f.file_name:
                return f.file_name.split("deepinfer_jax/")[-1] + ":" + f.function_name
        return "(outside the package)"

    def walk(jaxpr, mult: int) -> None:
        for e in jaxpr.eqns:
            name = e.primitive.name
            subs = []
            if name != "pallas_call":
                for v in e.params.values():
                    for x in (v if isinstance(v, (list, tuple)) else (v,)):
                        if isinstance(x, (jcore.ClosedJaxpr, jcore.Jaxpr)):
                            subs.append(x.jaxpr if isinstance(x, jcore.ClosedJaxpr) else x)
            if subs:
                m = mult * (e.params.get("length", 1) if name == "scan" else 1)
                for sj in subs:
                    walk(sj, m)
                if name in _TRANSPARENT:
                    continue
            c = counts.setdefault(where(e), [0, 0])
            c[0] += mult
            c[1] += mult * (name in _KERNEL_STARTERS)

    walk(closed_jaxpr.jaxpr, 1)
    return dict(sorted(counts.items(), key=lambda kv: -kv[1][1]))


def kernel_lowering_seconds(prof) -> dict:
    """Cumulative seconds (under ``prof``) of JAX's Pallas kernel-body lowerings: Mosaic GPU
    (``mosaic_gpu/lowering.py:lower_jaxpr_to_module``, with its layout inference) and Triton
    (``triton/lowering.py:lower_jaxpr_to_triton_module``)."""
    import pstats

    out = {"mosaic_gpu": 0.0, "triton": 0.0}
    for (file, _line, fn), (_cc, _nc, _tt, ct, _callers) in pstats.Stats(prof).stats.items():
        f = file.replace("\\", "/")
        if f.endswith("pallas/mosaic_gpu/lowering.py") and fn == "lower_jaxpr_to_module":
            out["mosaic_gpu"] += ct
        elif f.endswith("pallas/triton/lowering.py") and fn == "lower_jaxpr_to_triton_module":
            out["triton"] += ct
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="v41-small-code")
    ap.add_argument("--engine", default="{}", help="JSON of LLM keyword arguments")
    ap.add_argument("--variants", type=int, default=None, help="lower only the first N variants")
    ap.add_argument("--top", type=int, default=0, help="print the N costliest functions of the lowering")
    ap.add_argument("--census", type=int, default=0, metavar="N",
                    help="per variant, the N functions of this package emitting the most kernel-starting ops")
    ap.add_argument("--out", default=None, help="JSON path (default: none)")
    args = ap.parse_args(argv)
    kw = json.loads(args.engine)
    if not isinstance(kw, dict):
        ap.error(f"--engine {args.engine!r}: expected a JSON object")

    import jax

    from deepinfer_jax.entrypoints.llm import LLM

    llm = LLM(args.model, progress=False, precompile=False, **kw)
    runner = llm.runner
    variants = runner.variants()[:args.variants]
    profs = []
    rows = []
    print(f"{'T':>6} {'R':>5} {'Td':>6} {'trace s':>8} {'lower s':>8} {'triton':>7} {'mosaic':>7} "
          f"{'triton s':>8} {'mosaic s':>8}")
    with as_if_on_an_h200():
        for T, R, Td in variants:
            one = cProfile.Profile()
            one.enable()
            tr, lo, text, jaxpr = lower_variant(runner, T, R, Td)
            one.disable()
            profs.append(one)
            kernels_s = kernel_lowering_seconds(one)
            row = {"T": T, "R": R, "Td": Td, "trace_s": tr, "lower_s": lo,
                   "triton_sites": text.count("__gpu$xla.gpu.triton"),
                   "mosaic_gpu_sites": len(re.findall(r"custom_call @mosaic_gpu", text)),
                   "mosaic_gpu_lowering_s": kernels_s["mosaic_gpu"], "triton_lowering_s": kernels_s["triton"]}
            rows.append(row)
            print(f"{T:>6} {R:>5} {str(Td):>6} {tr:8.2f} {lo:8.2f} {row['triton_sites']:>7} {row['mosaic_gpu_sites']:>7} "
                  f"{row['triton_lowering_s']:8.2f} {row['mosaic_gpu_lowering_s']:8.2f}", flush=True)
            if args.census:
                census = op_census(jaxpr)
                row["op_census"] = census
                tot = [sum(c[0] for c in census.values()), sum(c[1] for c in census.values())]
                print(f"    ops {tot[0]}, kernel-starting {tot[1]}; by function (all / kernel-starting):")
                for fn_name, (a, u) in list(census.items())[:args.census]:
                    print(f"    {a:6d} {u:6d}  {fn_name}")
    tot_t, tot_l = sum(r["trace_s"] for r in rows), sum(r["lower_s"] for r in rows)
    tot_m, tot_tr = sum(r["mosaic_gpu_lowering_s"] for r in rows), sum(r["triton_lowering_s"] for r in rows)
    from deepinfer_jax.kernels_pallas import mosaic_lowering_cache

    memo = mosaic_lowering_cache.stats() if mosaic_lowering_cache.installed() else None
    print(f"{len(rows)} variants: trace {tot_t:.1f} s, lower {tot_l:.1f} s, of which the Pallas kernels' own lowering "
          f"(under the profiler) Mosaic GPU {tot_m:.1f} s, Triton {tot_tr:.1f} s (this host, jax {jax.__version__}); "
          + (f"Mosaic lowering memo: {memo['misses']} lowered, {memo['hits']} reused" if memo else "no Mosaic lowering memo"))
    if args.top:
        s = io.StringIO()
        pstats.Stats(*profs, stream=s).sort_stats("cumulative").print_stats(args.top)
        print(s.getvalue())
    if args.out:
        import datetime

        meta = {"model": args.model, "engine": kw, "jax": jax.__version__, "host_platform": jax.default_backend(),
                "mosaic_lowering_memo": memo,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
