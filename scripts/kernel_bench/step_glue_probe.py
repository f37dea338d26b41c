#!/usr/bin/env python3
"""Probe: what the small non-kernel ops of a step cost on the GPU, and two exact alternatives.

1. Routing glue of the MoE op (``moe_gmm.moe_experts``, ``moe_gmm.grouped_matmul``) at V4.1
   decode (M = 512 routed rows, 8 local experts), bf16 / fp8 / fp4 experts: the aligned layout
   with ``jnp.searchsorted`` (an XLA while loop) vs ``tiling.count_at_most`` (one compare-and-sum
   fusion; identical results). Rows ``moe_*``/``gmm_*`` with ``layout`` = ``searchsorted`` or
   ``compare``; the kernel alone (``gmm_kernel``) for reference.
2. mHC Sinkhorn (``mhc.sinkhorn_split``, hc = 4, 20 iterations) with the reference
   ``fori_loop`` (an XLA while loop) vs the Pallas kernel (``kernels_pallas/sinkhorn.py``, the
   whole loop in one launch), at T = 64 and 4096 tokens: 16 calls chained inside one jitted
   function (a data dependency between calls), time per call, and the max relative difference.

The layout alternatives compute the same values (checked here). Times: median of 5 runs of
``iters`` back-to-back dispatches after a warm-up. Rows are written to ``--json`` as they come
(a run cut short keeps what it measured).

Measured (H200, 2026-11-29, the first version of this script, which tried an unrolled loop in
place of the kernel): ``sinkhorn T=64 loop 419.80 us per call``; the unrolled variant did not
finish compiling within the run (XLA's "very slow compile" alarm), so the MoE rows did not run.

    python scripts/kernel_bench/step_glue_probe.py [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _searchsorted_count(sorted_E, v):
    import jax.numpy as jnp

    return jnp.searchsorted(sorted_E, v, side="right").astype(jnp.int32)


def moe_rows(M: int = 512, sink=None) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kernel_bench.moe_gmm import D_V41, E_LOCAL, F_V41, _timeit, _weights
    from deepinfer_jax.kernels_pallas import moe_gmm, tiling

    rows = []
    key = jax.random.PRNGKey(0)
    E, D, F = E_LOCAL, D_V41, F_V41
    x = jax.random.normal(key, (M, D), jnp.bfloat16)
    idx = jax.random.randint(jax.random.fold_in(key, 1), (M, 1), 0, E).astype(jnp.int32)
    wt = jax.random.uniform(jax.random.fold_in(key, 2), (M, 1), jnp.float32, 0.1, 1.0)
    sizes = jnp.bincount(idx[:, 0], length=E).astype(jnp.int32)
    xs = x[jnp.argsort(idx[:, 0], stable=True)]
    compare = tiling.count_at_most
    interp = jax.default_backend() != "gpu"  # CPU: a smoke run of the script (interpret mode)
    for fmt in ("bf16", "fp8", "fp4"):
        kw = jax.random.split(jax.random.fold_in(key, 10 + len(fmt)), 3)
        w1, w2, w3 = _weights(kw[0], fmt, E, F, D), _weights(kw[1], fmt, E, D, F), _weights(kw[2], fmt, E, F, D)
        outs = {}
        for layout, fn in (("searchsorted", _searchsorted_count), ("compare", compare)):
            tiling.count_at_most = fn  # the layout helpers look it up at trace time
            try:
                op = jax.jit(lambda *a, fmt=fmt: moe_gmm.moe_experts(*a, fmt, 10.0, E, interpret=interp))
                gm = jax.jit(lambda a, w, s, g, fmt=fmt: moe_gmm.grouped_matmul(a, w, s, g, fmt, interpret=interp))
                outs[layout] = (np.asarray(op(x, idx, wt, w1, w2, w3), np.float32),
                                np.asarray(gm(xs, *w1, sizes), np.float32))
                for name, f, args in (("moe_experts", op, (x, idx, wt, w1, w2, w3)), ("grouped_matmul", gm, (xs, *w1, sizes))):
                    t = _timeit(f, args, 20)
                    rows.append(dict(case=name, fmt=fmt, layout=layout, M=M, us=t * 1e6))
                    if sink:
                        sink(rows)
                    print(f"{name:<15} {fmt:<5} {layout:<12} {t * 1e6:8.1f} us", flush=True)
            finally:
                tiling.count_at_most = compare
        same = all(np.array_equal(a, b) for a, b in zip(outs["searchsorted"], outs["compare"]))
        rows.append(dict(case="same_values", fmt=fmt, ok=bool(same)))
        print(f"{fmt}: identical outputs {same}", flush=True)
    return rows


def sinkhorn_rows(sink=None) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kernel_bench.moe_gmm import _timeit
    from deepinfer_jax.kernels_pallas import sinkhorn
    from deepinfer_jax.layers import mhc

    rows = []
    interp = jax.default_backend() != "gpu"
    hc, iters, reps = 4, 20, 16
    Z = (2 + hc) * hc
    s3 = jnp.asarray([1.0, 1.0, 1.0], jnp.float32)
    b = jnp.zeros((Z,), jnp.float32)
    for T in (64, 4096):
        m = jax.random.normal(jax.random.PRNGKey(T), (T, Z), jnp.float32)
        res = {}
        for variant in ("loop", "kernel"):
            it = None if variant == "loop" else (
                lambda c, n, eps: sinkhorn.sinkhorn_iterate(c, n, eps, interpret=interp))

            def chain(m, it=it):
                acc = jnp.zeros((), jnp.float32)
                for _ in range(reps):  # each call depends on the previous one's result
                    pre, post, comb = mhc.sinkhorn_split(m + acc * 0, s3, b, hc, iters, 1e-6, iterate=it)
                    acc = acc + comb[0, 0, 0]
                return pre, post, comb, acc

            f = jax.jit(chain)
            res[variant] = np.asarray(f(m)[2])
            t = _timeit(f, (m,), 20) / reps
            rows.append(dict(case="sinkhorn", T=T, variant=variant, us=t * 1e6))
            print(f"sinkhorn T={T:<5} {variant:<7} {t * 1e6:8.2f} us per call", flush=True)
            if sink:
                sink(rows)
        d = float(np.max(np.abs(res["kernel"] - res["loop"]) / np.abs(res["loop"])))
        rows.append(dict(case="sinkhorn_max_rel_diff", T=T, value=d))
        print(f"sinkhorn T={T}: kernel vs loop max rel diff {d:.2e}", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    ap.add_argument("--skip-moe", action="store_true", help="only the Sinkhorn rows (runs on CPU too)")
    a = ap.parse_args(argv)
    import deepinfer_jax  # noqa: F401  (first: it sets the XLA numerics flags before a backend starts)
    import jax

    done: list[dict] = []

    def sink(rows):
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": done + rows}, f,
                          indent=1)

    done += sinkhorn_rows(sink)
    sink([])
    if not a.skip_moe:
        if jax.default_backend() != "gpu":
            raise SystemExit("the MoE rows need a GPU (compiled Mosaic GPU kernels); --skip-moe for the rest")
        done += moe_rows(sink=sink)
        sink([])
    return 0


if __name__ == "__main__":
    sys.exit(main())
