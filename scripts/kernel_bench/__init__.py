"""Kernel micro-benchmarks: one module per op, each with ``bench(quick) -> list[dict]`` and
``print_table(rows)``; ``scripts/bench_kernels.py`` runs them all, each also runs standalone."""

from __future__ import annotations

import argparse
import json
import time


def standalone_main(doc: str, bench, print_table, argv=None) -> int:
    """``python scripts/kernel_bench/<op>.py [--quick] [--json FILE]``."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer shapes and repeats")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args(argv)
    rows = bench(a.quick)
    print_table(rows)
    if a.json:
        import datetime

        import jax

        meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        with open(a.json, "w") as f:
            json.dump({**meta, "rows": rows}, f, indent=1)
    return 0


def chained_time(fn, args, iters: int, repeats: int = 3) -> float:
    """Device seconds per call of ``fn(*args)``: ``iters`` calls chained in one jitted
    ``fori_loop`` (one dispatch, no host overhead per call; the per-call host dispatch of ~35 us
    would otherwise swamp the small sizes). Each iteration feeds a data dependency back into
    ``args[0]`` (one element, value unchanged) so XLA cannot hoist the call out of the loop; the
    sum over the output that makes it is included in the time (one read of the output).
    Median over ``repeats`` timed runs after a compile/warm-up run."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    @jax.jit
    def loop(*a):
        def body(i, carry):
            a0, acc = carry
            out = fn(a0, *a[1:])
            # every output feeds the carry in full: XLA shrinks its own ops to what is used
            # (top_k with its indices unused was seen 7x faster than the full op)
            for leaf in jax.tree_util.tree_leaves(out):
                acc = acc + jnp.sum(leaf.astype(jnp.float32))
            idx = (0,) * a0.ndim
            bump = jnp.where(acc == 1234.5678, 1, 0).astype(a0.dtype)  # 0 at run time, opaque to XLA
            return a0.at[idx].set(a0[idx] + bump), acc

        return lax.fori_loop(0, iters, body, (a[0], jnp.float32(0)))[1]

    jax.block_until_ready(loop(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(loop(*args))
        times.append((time.perf_counter() - t0) / iters)
    times.sort()
    return times[len(times) // 2]


def back_to_back_time(fn, args, iters: int, repeats: int = 5) -> float:
    """Seconds per call of a jitted ``fn`` whose output is materialised: median over ``repeats``
    of the mean of ``iters`` calls dispatched back to back, after a compile + warm-up call."""
    import jax

    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = None
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / iters)
    times.sort()
    return times[len(times) // 2]


def copy_rate(n_elems: int, iters: int, repeats: int = 5) -> tuple[float, float]:
    """``(seconds, bytes/s)`` of ``a + 1`` written to a new array of ``n_elems`` bf16 values (2 GiB
    at ``1 << 30``): the copy bandwidth, bytes read + written, the baseline of the benches."""
    import jax
    import jax.numpy as jnp

    big = jax.random.normal(jax.random.PRNGKey(0), (n_elems,), jnp.bfloat16)
    t = back_to_back_time(jax.jit(lambda a: a + 1), (big,), iters, repeats)
    return t, 2 * n_elems * 2 / t
