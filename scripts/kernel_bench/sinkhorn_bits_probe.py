#!/usr/bin/env python3
"""Where the mHC Sinkhorn bits come from on this machine: each implementation against the numpy
oracle ``sinkhorn_ref.sinkhorn_iterate_np`` (fp32 IEEE division, each row's and column's entries
added left to right: the reference model's arithmetic), as mismatching entries and the largest
distance in fp32 ulps.

Rows: the jnp reference jitted on the default backend and on the CPU, the same without its
optimization barriers (what XLA's algebraic simplifier then does to it), and the Pallas kernel
(compiled where the backend is a GPU, interpreted otherwise). Prints a table, writes JSON.

    python scripts/kernel_bench/sinkhorn_bits_probe.py --out sinkhorn_bits.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def ulps(a, b):
    """Distance in fp32 units in the last place (both finite, same sign here)."""
    import numpy as np

    ia = np.asarray(a, np.float32).view(np.int32).astype(np.int64)
    ib = np.asarray(b, np.float32).view(np.int32).astype(np.int64)
    return np.abs(ia - ib)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 300, 4096])
    ap.add_argument("--steps", type=int, default=19)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from deepinfer_jax.kernels_pallas import sinkhorn, sinkhorn_ref

    eps = 1e-6
    backend = jax.default_backend()
    cpu = jax.devices("cpu")[0]

    def ref_no_barrier(c, n, eps):
        C = c.shape[-1]
        v = sinkhorn_ref.entries(c)
        v = jax.lax.fori_loop(0, n, lambda _, x: sinkhorn_ref.step(x, C, eps, barrier=False), v)
        return sinkhorn_ref.from_entries(v, C)

    ref = jax.jit(sinkhorn_ref.sinkhorn_iterate_ref, static_argnums=(1, 2))
    impls = [  # name, function, device its input is put on
        (f"ref ({backend})", ref, None),
        ("ref (cpu)", ref, cpu),
        (f"ref without barriers ({backend})", jax.jit(ref_no_barrier, static_argnums=(1, 2)), None),
        (f"kernel ({'compiled' if backend == 'gpu' else 'interpreted'})",
         lambda c, n, e: sinkhorn.sinkhorn_iterate(c, n, e, interpret=backend != "gpu"), None),
    ]
    rows = []
    for T in args.tokens:
        z = np.random.default_rng(T).standard_normal((T, 4, 4)).astype(np.float32) * 3
        c = np.exp(z - z.max(-1, keepdims=True))
        c = (c / c.sum(-1, keepdims=True) + 1e-6).astype(np.float32)
        want = sinkhorn_ref.sinkhorn_iterate_np(c, args.steps, eps)
        for name, fn, dev in impls:
            got = np.asarray(fn(jax.device_put(c, dev), args.steps, eps))
            u = ulps(got, want)
            rows.append(dict(tokens=T, impl=name, mismatched=int((u > 0).sum()), entries=int(u.size),
                             max_ulp=int(u.max())))
    print(f"{'tokens':>6}  {'implementation':<34} {'mismatched':>12} {'max ulp':>8}")
    for r in rows:
        print(f"{r['tokens']:>6}  {r['impl']:<34} {r['mismatched']:>6}/{r['entries']:<5} {r['max_ulp']:>8}")
    import datetime

    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), device=str(jax.devices()[0].device_kind), jax=jax.__version__, backend=backend, steps=args.steps)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
