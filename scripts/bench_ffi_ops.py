#!/usr/bin/env python3
"""kernels_ascend's C++ CPU custom calls against the jnp references (XLA CPU), for information.

Each op at a decode-like and a prefill-like shape of the v41-tiny scale and one larger: both
jitted, inputs from tests/ffi_cases.py, median wall time of ``--repeats`` calls after a warm-up.
The CPU targets are the test build of the Ascend bridge (plain loops, one thread), not tuned
kernels: the numbers say what ``kernels="ffi"`` costs on a CPU, nothing about Ascend.

    python scripts/bench_ffi_ops.py [--quick] [--repeats N] [--out benchmarks/results/ffi_ops_cpu.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from ffi_cases import attention_case, indexer_case, moe_case, pool_case  # noqa: E402


def cases(quick: bool):
    """(op, shape label, ffi fn, reference fn, args) rows."""
    from deepinfer_jax.kernels_ascend import kernels
    from deepinfer_jax.kernels_pallas import indexer_topk_ref as itr, moe_gmm_ref, sinkhorn_ref, sparse_attention_ref

    K = kernels.kernels_for("cpu")
    rng = np.random.default_rng(0)
    rows = []
    for T, M in ((8, 128), (64, 512)) + (() if quick else ((256, 1024),)):
        a = attention_case(rng, T, 8, 64, (M - 64, 64), (4 * M, 256))
        rows.append(("sparse_attention", f"T={T} H=8 A=64 M={M}", lambda q, p, i, s: K["sparse_attention"](q, p, i, s, 0.125),
                     lambda q, p, i, s: sparse_attention_ref.sparse_attention_ref(q, p, i, s, 0.125), a))
    for T, N in ((8, 256), (64, 1024)) + (() if quick else ((128, 4096),)):
        a = pool_case(rng, T, 8, N, 4, N, 64)
        rows.append(("indexer_scores_pool", f"T={T} I=8 N={N} J=64", K["indexer_scores_pool"],
                     itr.indexer_scores_pool_ref, a))
        s = itr.indexer_scores_ref(*indexer_case(rng, T, 2, N, 32))
        rows.append(("topk_positions", f"T={T} N={N} k=64", lambda x: K["topk_positions"](x, 64),
                     lambda x: itr.topk_positions_ref(x, 64), (s,)))
    for T in (64, 1024) + (() if quick else (8192,)):
        c = (jax.numpy.asarray(rng.random((T, 4, 4)) + 0.01, jax.numpy.float32),)
        rows.append(("sinkhorn_iterate", f"T={T} C=4 n=19", lambda x: K["sinkhorn_iterate"](x, 19, 1e-6),
                     lambda x: sinkhorn_ref.sinkhorn_iterate_ref(x, 19, 1e-6), c))
    for fmt in ("fp8", "fp4"):
        for T in (8, 64) + (() if quick else (256,)):
            a = moe_case(rng, fmt, T, 6, 256, 128, 16)
            rows.append(("moe_experts", f"{fmt} T={T} X=6 D=256 F=128 E=16",
                         lambda *a, f=fmt: K["moe_experts"](*a, f, 7.0, 16),
                         lambda *a, f=fmt: moe_gmm_ref.moe_experts_ref(*a, f, 7.0, 16), a))
    return rows


def median_ms(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="two shapes per op")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=os.path.join(HERE, "..", "benchmarks", "results", "ffi_ops_cpu.json"))
    args = ap.parse_args(argv)
    results = []
    print(f"{'op':<20} {'shape':<34} {'ffi ms':>9} {'ref ms':>9} {'ref/ffi':>8}")
    for op, shape, ffi_fn, ref_fn, a in cases(args.quick):
        t_ffi = median_ms(jax.jit(ffi_fn), a, args.repeats)
        t_ref = median_ms(jax.jit(ref_fn), a, args.repeats)
        results.append({"op": op, "shape": shape, "ffi_ms": round(t_ffi, 4), "ref_ms": round(t_ref, 4)})
        print(f"{op:<20} {shape:<34} {t_ffi:9.3f} {t_ref:9.3f} {t_ref / t_ffi:8.2f}", flush=True)
    meta = {"device": "cpu", "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "jax": jax.__version__, "date": datetime.date.today().isoformat(), "repeats": args.repeats,
            "note": "C++ CPU test build of kernels_ascend vs the jnp references on XLA CPU; shared machine"}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
