#!/usr/bin/env python3
"""The mHC Sinkhorn (first step + 19 steps, ``ops.sinkhorn``) on the GPU: XLA vs the Pallas kernel.

Rows per token count T (C = 4 copies, 20 iterations, eps 1e-6: the model's ``sinkhorn_split``):
  xla           ``sinkhorn_ref.sinkhorn_ref``: the jnp first step, then the steps' ``fori_loop``
                (what XLA makes of the reference without kernels): the baseline
  kernel_rn     ``sinkhorn.sinkhorn_iterate(first_step=True, division="rn")``: PTX ``div.rn.f32``
  kernel_fma    the same with ``division="fma"`` (the branch-free fast path of that division)
``x_xla`` = xla time / row time; ``oracle`` = whether the row's output equals the numpy oracle
``sinkhorn_ref.sinkhorn_np`` bit for bit (the reference's own arithmetic), ``max ulp`` the largest
distance from it. Inputs: softmax numerators of logits with standard deviation 3 (as the model's
``_numerators`` test inputs). Times are device times per call (``kernel_bench.chained_time``).

    python scripts/kernel_bench/sinkhorn.py [--quick] [--json FILE]
Needs a GPU for the kernel rows (on CPU only the xla row runs, as a smoke test).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # kernel_bench

ITERS, EPS, C = 20, 1e-6, 4


def bench(quick: bool = False) -> list[dict]:
    import functools

    import deepinfer_jax  # noqa: F401  (first: it sets the XLA numerics flags before a backend starts)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kernel_bench import chained_time
    from kernel_bench.sinkhorn_bits_probe import ulps
    from deepinfer_jax.kernels_pallas import sinkhorn, sinkhorn_ref

    gpu = jax.default_backend() == "gpu"
    sizes = ([16, 1024] if quick else [16, 64, 256, 1024, 4096]) if gpu else [16]
    impls = {"xla": jax.jit(lambda c: sinkhorn_ref.sinkhorn_ref(c, ITERS, EPS))}
    if gpu:
        for div in ("rn", "fma"):
            impls[f"kernel_{div}"] = functools.partial(sinkhorn.sinkhorn_iterate, n=ITERS - 1, eps=EPS,
                                                       first_step=True, division=div)
    rows = []
    for T in sizes:
        z = np.random.default_rng(T).standard_normal((T, C, C)).astype(np.float32) * 3
        c = jnp.asarray(np.exp(z - z.max(-1, keepdims=True)), jnp.float32)
        want = sinkhorn_ref.sinkhorn_np(c, ITERS, EPS)
        base = None
        for name, fn in impls.items():
            got = np.asarray(fn(c))
            t = chained_time(fn, (c,), iters=20 if quick else 100)
            base = t if base is None else base
            rows.append({"T": T, "impl": name, "us": t * 1e6, "x_xla": base / t,
                         "oracle": bool(np.array_equal(got, want)), "max_ulp": int(ulps(got, want).max())})
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'T':>6} {'impl':12} {'us':>9} {'x_xla':>7} {'oracle':>7} {'max ulp':>8}")
    for r in rows:
        print(f"{r['T']:>6} {r['impl']:12} {r['us']:9.2f} {r['x_xla']:7.2f} {str(r['oracle']):>7} {r['max_ulp']:>8}")


def main(argv=None) -> int:
    from kernel_bench import standalone_main

    return standalone_main(__doc__, bench, print_table, argv)


if __name__ == "__main__":
    sys.exit(main())
