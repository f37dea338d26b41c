#!/usr/bin/env python3
"""Indexer scoring + top-k (Pallas) vs ``jax.lax.top_k`` on the same scores and vs the jnp path.

Shapes: T tokens in {64, 256}, N positions in {16384, 65536, 131072}, the V4.1 indexer (I = 32
heads, J = 128, k = 512, from ``ModelConfig``); every token sees all N positions (worst case).

Rows per (T, N):
  lax_top_k     ``jax.lax.top_k(scores_bf16, k)`` alone, scores precomputed: the baseline
  ref_path      ``indexer_scores_ref`` + ``topk_positions_ref`` (the jnp path the model runs now)
  select        our ``topk_positions`` alone on the precomputed scores
  ours_gather   our ``indexer_scores`` (keys gathered per token ``[T, N, J]``: T*N*J*2 bytes of
                keys, the decode case, each token its own request) + ``topk_positions``
  ours_shared   our ``indexer_scores_pool`` with all T tokens on one request row (prefill case:
                N*J*2 bytes of keys, L2-resident re-reads) + ``topk_positions``
  ours_shared_fp8  the same on the model's cache format: e5m2 codes + a power-of-two scale per key
                (``quant.pack_index_keys``; N*(J+4) bytes)
  scores_rows / ours_rows  ``indexer_scores_pool`` with every token on its own request row (the
                model's decode path: T*N*J*2 key bytes read through the entry index), alone / +
                ``topk_positions``
  scores_rows_fp8 / ours_rows_fp8  the same on the coded cache (T*N*(J+4) key bytes)
``x_top_k`` = lax_top_k time / row time (the goal: >= 10 for scoring + select). ``GB/s`` counts
the key bytes once (+ scores written and read twice). ``floor`` = max(bytes / 4.3 TB/s,
FLOPs / 790 TFLOP/s) with those bytes (the copy and bf16 GEMM rates measured on an H200 here).
Times are device times per call (calls chained in one jitted loop; see ``kernel_bench.chained_time``); inputs are
not rotated, so data that fits the 60 MB L2 (scores at T=64, N=16k) is timed warm, for the
baseline and for us alike.

    python scripts/kernel_bench/indexer_topk.py            # all sizes
    python scripts/kernel_bench/indexer_topk.py --quick    # two sizes
Needs a GPU (on CPU it runs the tiny interpret-mode shapes only as a smoke test).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # kernel_bench

from kernel_bench import chained_time as _timeit  # noqa: E402

HBM_BPS = 4.3e12
MMA_FLOPS = 790e12


def bench(quick: bool = False) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.kernels_pallas import indexer_topk as K
    from deepinfer_jax.kernels_pallas import indexer_topk_ref as R

    cfg = ModelConfig()
    I, J, k = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
    on_gpu = jax.default_backend() == "gpu"
    if on_gpu:
        sizes = [(64, 16384), (256, 131072)] if quick else [(T, N) for T in (64, 256) for N in (16384, 65536, 131072)]
    else:
        sizes, I, J, k = [(4, 512)], 16, 32, 64
    interp = not on_gpu
    rows: list[dict] = []
    key = jax.random.PRNGKey(0)
    for T, N in sizes:
        ks = jax.random.split(jax.random.fold_in(key, T * N), 6)
        q = jax.random.normal(ks[0], (T, I, J), jnp.bfloat16)
        w = (jax.random.normal(ks[1], (T, I), jnp.float32) * (I * J) ** -0.5).astype(jnp.bfloat16)
        keys = (jax.random.normal(ks[2], (T, N, J), jnp.float32) * 0.3).astype(jnp.bfloat16)
        nv = jnp.full((T,), N, jnp.int32)
        pool = keys[0]  # one request row holding N entries
        entry = jnp.arange(N, dtype=jnp.int32)[None]
        trow = jnp.zeros((T,), jnp.int32)

        from deepinfer_jax.base import quant

        # the model's cache format (the bench's keys are not fp4-QDQ'd, so the codes round them:
        # the coded rows are checked against the reference on the same codes)
        codes, kscale = quant.pack_index_keys(keys.reshape(T * N, J))
        if K._i32_offsets_overflow(codes):  # 2^31..2^32 one-byte elements: one more row -> 64-bit offsets
            codes, kscale = jnp.pad(codes, ((0, 1), (0, 0))), jnp.pad(kscale, (0, 1), constant_values=1.0)
        entry_rows = jnp.arange(T * N, dtype=jnp.int32).reshape(T, N)
        trow_rows = jnp.arange(T, dtype=jnp.int32)
        scores = [K.indexer_scores(q, keys, w, nv, interpret=interp)]
        jax.block_until_ready(scores)
        # correctness spot checks at this size
        ok_sel = bool(jnp.all(K.topk_positions(scores[0], k, interpret=interp) == R.topk_positions_ref(scores[0], k)))
        ref_s = R.indexer_scores_ref(q, keys, w, nv)
        d = jnp.abs(ref_s.astype(jnp.float32) - scores[0].astype(jnp.float32))
        frac_diff = float(jnp.mean((d > 0).astype(jnp.float32)))
        del ref_s, d

        iters = 10 if on_gpu else 1

        def topk_fn(s):
            return jax.lax.top_k(s, k)

        def sel_fn(s):
            return K.topk_positions(s, k, interpret=interp)

        def ref_fn(q, kk, w, nv):
            return R.topk_positions_ref(R.indexer_scores_ref(q, kk, w, nv), k)

        def gat_fn(q, kk, w, nv):
            return K.topk_positions(K.indexer_scores(q, kk, w, nv, interpret=interp), k, interpret=interp)

        def scr_fn(q, kk, w, nv):
            return K.indexer_scores(q, kk, w, nv, interpret=interp)

        def shr_fn(q, p, e, r, w, nv, ps=None):
            return K.topk_positions(K.indexer_scores_pool(q, p, e, r, w, nv, ps, interpret=interp), k, interpret=interp)

        def pool_fn(q, p, e, r, w, nv, ps=None):
            return K.indexer_scores_pool(q, p, e, r, w, nv, ps, interpret=interp)

        # coded rows vs the reference on the same codes (selection on our scores must be exact)
        s_fp8 = pool_fn(q, codes, entry_rows, trow_rows, w, nv, kscale)
        r_fp8 = R.indexer_scores_pool_ref(q, codes, entry_rows, trow_rows, w, nv, kscale)
        d8 = jnp.abs(r_fp8.astype(jnp.float32) - s_fp8.astype(jnp.float32))
        frac_diff_fp8 = float(jnp.mean((jnp.where(jnp.isfinite(d8), d8, 0) > 0).astype(jnp.float32)))
        ok_sel = ok_sel and bool(jnp.all(K.topk_positions(s_fp8, k, interpret=interp)
                                         == R.topk_positions_ref(s_fp8, k)))
        del s_fp8, r_fp8, d8

        t_topk = _timeit(topk_fn, (scores[0],), iters)
        t_sel = _timeit(sel_fn, (scores[0],), iters)
        t_ref = _timeit(ref_fn, (q, keys, w, nv), max(1, iters // 4))
        t_gat = _timeit(gat_fn, (q, keys, w, nv), iters)
        t_scr = _timeit(scr_fn, (q, keys, w, nv), iters)
        t_shr = _timeit(shr_fn, (q, pool, entry, trow, w, nv), iters)
        pcodes, pscale = quant.pack_index_keys(pool)
        t_shr8 = _timeit(shr_fn, (q, pcodes, entry, trow, w, nv, pscale), iters)
        pool_rows = keys.reshape(T * N, J)
        t_prow = _timeit(pool_fn, (q, pool_rows, entry_rows, trow_rows, w, nv), iters)
        t_orow = _timeit(shr_fn, (q, pool_rows, entry_rows, trow_rows, w, nv), iters)
        t_prow8 = _timeit(pool_fn, (q, codes, entry_rows, trow_rows, w, nv, kscale), iters)
        t_orow8 = _timeit(shr_fn, (q, codes, entry_rows, trow_rows, w, nv, kscale), iters)
        del keys, pool, pool_rows, codes

        flops = 2.0 * T * N * I * J
        sb = T * N * 2  # one pass over the bf16 scores
        case = {
            "lax_top_k": (t_topk, sb, 0.0),
            "ref_path": (t_ref, T * N * J * 2 + sb * 2, flops),
            "select": (t_sel, 3 * sb, 0.0),
            "scores_gather": (t_scr, T * N * J * 2 + sb, flops),
            "ours_gather": (t_gat, T * N * J * 2 + 3 * sb, flops),
            "ours_shared": (t_shr, N * J * 2 + 3 * sb, flops),
            "ours_shared_fp8": (t_shr8, N * (J + 4) + 3 * sb, flops),
            "scores_rows": (t_prow, T * N * J * 2 + sb, flops),
            "ours_rows": (t_orow, T * N * J * 2 + 3 * sb, flops),
            "scores_rows_fp8": (t_prow8, T * N * (J + 4) + sb, flops),
            "ours_rows_fp8": (t_orow8, T * N * (J + 4) + 3 * sb, flops),
        }
        for name, (t, nbytes, fl) in case.items():
            floor = max(nbytes / HBM_BPS, fl / MMA_FLOPS)
            rows.append(dict(T=T, N=N, I=I, J=J, k=k, case=name, ms=t * 1e3, x_top_k=t_topk / t,
                             gbps=nbytes / t / 1e9, floor_ms=floor * 1e3, of_floor=floor / t,
                             select_exact=ok_sel, score_frac_diff=frac_diff, score_frac_diff_fp8=frac_diff_fp8))
        print(f"T={T} N={N}: top_k {t_topk*1e3:.3f} ms, select {t_sel*1e3:.3f} ms, ours_gather {t_gat*1e3:.3f} ms, "
              f"ours_shared {t_shr*1e3:.3f} ms (fp8 keys {t_shr8*1e3:.3f}), rows {t_orow*1e3:.3f} ms "
              f"(fp8 keys {t_orow8*1e3:.3f}), ref {t_ref*1e3:.3f} ms, exact={ok_sel}, "
              f"scores differing {frac_diff:.2e} (fp8 keys {frac_diff_fp8:.2e})", flush=True)
    return rows


def print_table(rows: list[dict]) -> None:
    hdr = f"{'T':>4} {'N':>7} {'case':<16} {'ms':>9} {'x_top_k':>8} {'GB/s':>8} {'floor_ms':>9} {'%floor':>7}"
    print(hdr)
    for r in rows:
        print(f"{r['T']:>4} {r['N']:>7} {r['case']:<16} {r['ms']:>9.3f} {r['x_top_k']:>8.2f} {r['gbps']:>8.0f} "
              f"{r['floor_ms']:>9.3f} {100 * r['of_floor']:>6.0f}%")


def main(argv=None) -> int:
    from kernel_bench import standalone_main

    return standalone_main(__doc__, bench, print_table, argv)


if __name__ == "__main__":
    sys.exit(main())
