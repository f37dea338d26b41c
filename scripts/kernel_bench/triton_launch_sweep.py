#!/usr/bin/env python3
"""Launch parameters of the Triton-lowered kernels, measured: which (heads or tokens per program,
warps, pipeline stages, tile size) runs fastest, and do the default heuristics pick it?

Sparse attention (``sparse_attention.sparse_attention``, exact=True, V4.1 decode: H=64, A=512,
a 128-entry window + top-512 of a 64k pool, one token per request): ``block_h`` x ``num_warps``
x ``num_stages``. Rows: time, GB/s over the bytes the op must move (selected rows + q + o +
indices, as ``sparse_attention.py``'s bench), ``of_copy``, and ``err`` (max |out - default| /
max |default|, the default launch's output as the reference: a launch must not change results).

Indexer scoring, keys gathered per token (``indexer_topk.indexer_scores``, the decode case:
every token its own request, T*N*J*2 key bytes): ``block_n`` x ``tiles_per_program`` x
``num_warps`` x ``num_stages``; and keys in the pool shared by all tokens
(``indexer_scores_pool``, the prefill case): ``block_n`` x ``tokens_per_program`` x ``num_warps``
x ``num_stages``. Same columns (GB/s over key bytes + scores written).

Copy is measured in the same run (``-x`` over 1 GiB of bf16: read + write). ``default`` marks the
launch the heuristics pick. A launch Triton rejects (shared memory, registers) is listed with
its error and skipped.

    python scripts/kernel_bench/triton_launch_sweep.py [--ops sparse,scores,pool] [--budget-s 400]
        [--json FILE]
Needs a GPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


class _Budget:
    def __init__(self, seconds: float):
        self.t0, self.seconds = time.time(), seconds

    def spent(self) -> bool:
        return time.time() - self.t0 > self.seconds


def _row(rows, copy_bps, nbytes, t, ref, out, **kw):
    import numpy as np

    r = dict(kw, us=t * 1e6, gbps=nbytes / t / 1e9, of_copy=nbytes / t / copy_bps)
    if ref is not None:
        o = np.asarray(out, np.float32)
        fin = np.isfinite(ref)
        r["err"] = float(np.abs(np.where(fin, o - ref, 0)).max() / max(np.abs(np.where(fin, ref, 0)).max(), 1e-30))
        r["nonfinite_mismatch"] = int(np.sum(np.isfinite(o) != fin))
    rows.append(r)
    keys = {k: v for k, v in kw.items() if k not in ("op",)}
    print(f"{kw['op']:<7} {r['us']:9.1f} us {r['gbps']:7.0f} GB/s {r['of_copy']:5.2f} of copy "
          f"err {r.get('err', 0):.1e} {keys}", flush=True)


def _measure(rows, copy_bps, nbytes, ref, run, kw):
    """``run() -> (output, seconds)``; a launch Triton rejects (shared memory, registers) is
    recorded with its error and the sweep goes on."""
    try:
        out, t = run()
    except Exception as e:  # noqa: BLE001
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:150]}"
        print(f"{kw['op']} {kw}: {why}", flush=True)
        rows.append(dict(kw, error=why))
        return
    _row(rows, copy_bps, nbytes, t, ref, out, **kw)


def sweep_sparse(rows, copy_bps, budget: _Budget, Ts=(64, 256)):
    import jax
    import numpy as np

    from kernel_bench.sparse_attention import _make_inputs, _timeit
    from deepinfer_jax.kernels_pallas import sparse_attention as S

    H, A, W, K, N = 64, 512, 128, 512, 65536
    scale = A ** -0.5
    gen = S._gen_tuning()
    for T in Ts:
        sets = [_make_inputs(jax.random.key(100 * T + i), T, 1, H, A, W, K, N, False) for i in range(3)]
        M = W + K
        nbytes = T * M * A * 2 + 2 * T * H * A * 2 + T * M * 4
        bh0 = S.pick_block_h(H, T, gen)
        nw0, ns0 = S.pick_launch(bh0, A, gen)
        ref = np.asarray(S.sparse_attention(*sets[0], scale, True), np.float32)
        for bh, nw, ns in itertools.product((32, 64), (4, 8, 16), (1, 2, 3)):
            if budget.spent():
                print("budget spent", flush=True)
                return
            kw = dict(op="sparse", T=T, block_h=bh, num_warps=nw, num_stages=ns,
                      default=(bh, nw, ns) == (bh0, nw0, ns0))
            fn = jax.jit(lambda q, p, i, s, bh=bh, nw=nw, ns=ns: S.sparse_attention(
                q, p, i, s, scale, True, block_h=bh, num_warps=nw, num_stages=ns))
            _measure(rows, copy_bps, nbytes, ref, lambda: (fn(*sets[0]), _timeit(fn, sets, 20)), kw)
        del sets


def _indexer_inputs(T, N, I, J, seed=0):
    import jax
    import jax.numpy as jnp

    ks = jax.random.split(jax.random.PRNGKey(seed + T * N), 3)
    q = jax.random.normal(ks[0], (T, I, J), jnp.bfloat16)
    w = (jax.random.normal(ks[1], (T, I), jnp.float32) * (I * J) ** -0.5).astype(jnp.bfloat16)
    return q, w, ks[2]


def sweep_scores(rows, copy_bps, budget: _Budget, sizes=((64, 16384), (256, 16384))):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kernel_bench.indexer_topk import _timeit
    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.kernels_pallas import indexer_topk as K

    cfg = ModelConfig()
    I, J = cfg.index_n_heads, cfg.index_head_dim
    for T, N in sizes:
        q, w, kk = _indexer_inputs(T, N, I, J)
        keys = (jax.random.normal(kk, (T, N, J), jnp.float32) * 0.3).astype(jnp.bfloat16)
        nv = jnp.full((T,), N, jnp.int32)
        nbytes = T * N * J * 2 + T * N * 2
        ref = np.asarray(K.indexer_scores(q, keys, w, nv), np.float32)
        BN0, TPP0, _ = K._score_blocking(T, N, None, None)
        for bn, tpp, nw, ns in itertools.product((64, 128, 256), (None, 4), (4, 8), (2, 3)):
            if budget.spent():
                print("budget spent", flush=True)
                return
            BN, TPP, _ = K._score_blocking(T, N, bn, tpp)
            kw = dict(op="scores", T=T, N=N, block_n=BN, tiles_per_program=TPP, num_warps=nw, num_stages=ns,
                      default=(BN, TPP, nw, ns) == (BN0, TPP0, 4, 3))
            if tpp is not None and TPP == K._score_blocking(T, N, bn, None)[1]:
                continue  # same as the default tiles_per_program: measured in the None row
            fn = jax.jit(lambda q, k, w, n, bn=bn, tpp=tpp, nw=nw, ns=ns: K.indexer_scores(
                q, k, w, n, block_n=bn, tiles_per_program=tpp, num_warps=nw, num_stages=ns))
            _measure(rows, copy_bps, nbytes, ref, lambda: (fn(q, keys, w, nv), _timeit(fn, (q, keys, w, nv), 10)), kw)
        del keys


def sweep_pool(rows, copy_bps, budget: _Budget, sizes=((256, 131072),)):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kernel_bench.indexer_topk import _timeit
    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.kernels_pallas import indexer_topk as K

    cfg = ModelConfig()
    I, J = cfg.index_n_heads, cfg.index_head_dim
    for T, N in sizes:
        q, w, kk = _indexer_inputs(T, N, I, J)
        pool = (jax.random.normal(kk, (N, J), jnp.float32) * 0.3).astype(jnp.bfloat16)
        entry = jnp.arange(N, dtype=jnp.int32)[None]
        trow = jnp.zeros((T,), jnp.int32)
        nv = jnp.full((T,), N, jnp.int32)
        nbytes = N * J * 2 + T * N * 2
        args = (q, pool, entry, trow, w, nv)
        ref = np.asarray(K.indexer_scores_pool(*args), np.float32)
        TB0 = max(1, 64 // I)
        for bn, tb, nw, ns in itertools.product((64, 128), (1, 2, 4), (4, 8), (2, 3)):
            if budget.spent():
                print("budget spent", flush=True)
                return
            kw = dict(op="pool", T=T, N=N, block_n=bn, tokens_per_program=tb, num_warps=nw, num_stages=ns,
                      default=(bn, tb, nw, ns) == (64, TB0, 4, 3))
            fn = jax.jit(lambda *a, bn=bn, tb=tb, nw=nw, ns=ns: K.indexer_scores_pool(
                *a, block_n=bn, tokens_per_program=tb, num_warps=nw, num_stages=ns))
            _measure(rows, copy_bps, nbytes, ref, lambda: (fn(*args), _timeit(fn, args, 10)), kw)
        del pool


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default="sparse,pool,scores")
    ap.add_argument("--budget-s", type=float, default=400.0, help="stop starting new launches after this long")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    import deepinfer_jax  # noqa: F401  (first: it sets the XLA numerics flags before a backend starts)
    import jax

    if jax.default_backend() != "gpu":
        raise SystemExit("needs a GPU (compiled Triton kernels)")
    from kernel_bench.sparse_attention import measure_ceilings

    copy_bps, _ = measure_ceilings(True)
    print(f"copy {copy_bps / 1e9:.0f} GB/s", flush=True)
    rows: list[dict] = []
    budget = _Budget(a.budget_s)
    ops = a.ops.split(",")
    try:
        for op, fn in (("sparse", sweep_sparse), ("pool", sweep_pool), ("scores", sweep_scores)):
            if op in ops:
                fn(rows, copy_bps, budget)
    finally:
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "copy_gbps": copy_bps / 1e9,
                           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows}, f, indent=1)
    for op in ops:
        ok = [r for r in rows if r.get("op") == op and "us" in r]
        for key in sorted({r.get("T", 0) for r in ok}):
            grp = [r for r in ok if r.get("T") == key]
            best = min(grp, key=lambda r: r["us"])
            dflt = [r for r in grp if r.get("default")]
            print(f"{op} T={key}: best {best['us']:.1f} us ({best['of_copy']:.2f} of copy) "
                  f"{ {k: v for k, v in best.items() if k in ('block_h', 'block_n', 'tiles_per_program', 'tokens_per_program', 'num_warps', 'num_stages')} }"
                  + (f"; default {dflt[0]['us']:.1f} us" if dflt else "; default not measured"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
