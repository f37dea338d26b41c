#!/usr/bin/env python3
"""The LM head's fp32 product: the three-part bf16 split (``f32_matmul_bf16x3``, the GPU's
``ops.f32_matmul``) against the reference path (``f32_matmul_ref``: the bf16 weight converted to
fp32, then an fp32 GEMM at full precision) and the measured copy rate, in one run.

Shapes: V4.1-Flash's head (D 5120, V 129280; ``ModelConfig``'s full widths), rows 64 / 256 /
1024 (decode at 64 requests, 64 x 4 verification tokens, a large batch). Per row: device time,
the weight's bytes over the time (``GB/s``), that over the copy rate measured here (``of_copy``:
a 2 GiB ``a + 1``, bytes read + written; the target is >= 0.7; the ``read`` row is a read-only
pass for comparison), the speedup over the reference, and the error of each product against an
fp64 product on the first 2048 vocabulary columns, scaled by ``|x| @ |w|`` (``err``).

    python scripts/kernel_bench/lm_head.py [--quick]
Needs a GPU for the numbers (on CPU it runs a small shape as a smoke test).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # kernel_bench

from kernel_bench import chained_time as _timeit  # noqa: E402
from kernel_bench import copy_rate  # noqa: E402


def bench(quick: bool = False) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.kernels_pallas import f32_matmul_bf16x3 as S
    from deepinfer_jax.kernels_pallas import f32_matmul_ref as R

    on_gpu = jax.default_backend() == "gpu"
    cfg = ModelConfig()
    D, V = (cfg.hidden_size, cfg.vocab_size) if on_gpu else (256, 4096)
    row_counts = ((64, 1024) if quick else (64, 256, 1024)) if on_gpu else (8,)
    iters = 20 if on_gpu else 2
    key = jax.random.PRNGKey(0)
    w_DV = (jax.random.normal(key, (D, V), jnp.float32) * D ** -0.5).astype(jnp.bfloat16)
    n_copy = (1 << 30) if on_gpu else (1 << 20)
    # copy: ``a + 1`` written to a new 2 GiB array, bytes read + written (kernel_bench.copy_rate);
    # read: ``sum(a + 1)``, one read pass (XLA fuses the add into the reduction)
    t_copy, copy_bps = copy_rate(n_copy, iters)
    big = jax.random.normal(key, (n_copy,), jnp.bfloat16)
    t_read = _timeit(lambda a: a + 1, (big.reshape(1, -1),), iters)
    del big
    rows = [dict(path="copy", T=0, time_us=t_copy * 1e6, gbps=copy_bps / 1e9, of_copy=1.0, speedup=0.0, err=0.0),
            dict(path="read", T=0, time_us=t_read * 1e6, gbps=n_copy * 2 / t_read / 1e9,
                 of_copy=n_copy * 2 / t_read / copy_bps, speedup=0.0, err=0.0)]
    w_bytes = D * V * 2
    cols = min(V, 2048)
    w64 = np.asarray(w_DV[:, :cols].astype(jnp.float32), np.float64)
    for T in row_counts:
        x = jax.random.normal(jax.random.fold_in(key, T), (T, D), jnp.float32) * 2.0
        x64 = np.asarray(x, np.float64)
        exact, scale = x64 @ w64, np.abs(x64) @ np.abs(w64)
        t_ref = None
        for name, fn in (("reference", R.f32_matmul_ref), ("bf16x3", S.f32_matmul_bf16x3)):
            t = _timeit(fn, (x, w_DV), iters)
            y = np.asarray(jax.jit(fn)(x, w_DV)[:, :cols], np.float64)
            t_ref = t if t_ref is None else t_ref
            rows.append(dict(path=name, T=T, time_us=t * 1e6, gbps=w_bytes / t / 1e9,
                             of_copy=w_bytes / t / copy_bps, speedup=t_ref / t,
                             err=float((np.abs(y - exact) / scale).max())))
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'path':<10} {'T':>5} {'time_us':>10} {'GB/s':>8} {'of_copy':>8} {'speedup':>8} {'err':>9}")
    for r in rows:
        print(f"{r['path']:<10} {r['T']:>5} {r['time_us']:>10.1f} {r['gbps']:>8.0f} {r['of_copy']:>8.2f} "
              f"{r['speedup']:>8.2f} {r['err']:>9.2e}")


def main(argv=None) -> int:
    import argparse
    import datetime
    import json

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/lm_head_<device>.json)")
    args = ap.parse_args(argv)
    import deepinfer_jax  # noqa: F401  (first: the XLA numerics flags)
    import jax

    rows = bench(args.quick)
    print_table(rows)
    device = jax.devices()[0].device_kind
    out = args.out or os.path.join("benchmarks", "results", f"lm_head_{device.replace(' ', '_')}.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "device": device, "jax": jax.__version__, "rows": rows}, f, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
