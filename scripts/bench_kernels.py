#!/usr/bin/env python3
"""The Pallas kernels and the LM head's split product against their baselines on this machine's
GPU, one table each.

Runs ``bench(quick)`` of ``scripts/kernel_bench/{moe_gmm,sparse_attention,indexer_topk,lm_head,sinkhorn}.py``
(each times our kernel and the baselines measured in the same run: dense bf16 matmul and
``jax.lax.ragged_dot``, the jnp gather+einsum attention, ``jax.lax.top_k``, the fp32 GEMM of the
reference head, XLA's code for the Sinkhorn reference, and the measured copy bandwidth), prints their tables and writes one JSON with the device, jax version and date.

    python scripts/bench_kernels.py [--quick] [--only moe_gmm,sparse_attention] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

BENCHES = ("moe_gmm", "sparse_attention", "indexer_topk", "lm_head", "sinkhorn")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer shapes and repeats")
    ap.add_argument("--only", default=",".join(BENCHES), help=f"comma-separated subset of {BENCHES}")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/kernels_<device>.json)")
    args = ap.parse_args(argv)
    import deepinfer_jax  # noqa: F401  (first: it sets the XLA numerics flags before a backend starts)
    import jax

    device = jax.devices()[0].device_kind
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": device, "platform": jax.default_backend(), "jax": jax.__version__,
              "quick": args.quick, "kernels": {}}
    for name in args.only.split(","):
        if name not in BENCHES:
            raise SystemExit(f"--only: unknown benchmark {name!r}; known: {BENCHES}")
        mod = importlib.import_module(f"kernel_bench.{name}")
        print(f"== {name}")
        try:
            rows = mod.bench(args.quick)
        except Exception as e:  # one broken kernel must not hide the others' numbers
            print(f"{name}: failed: {type(e).__name__}: {e}")
            result["kernels"][name] = {"error": f"{type(e).__name__}: {e}"}
            continue
        mod.print_table(rows)
        result["kernels"][name] = rows
    out = args.out or os.path.join("benchmarks", "results", f"kernels_{device.replace(' ', '_')}.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
