#!/usr/bin/env python3
"""Decode tilings of the MoE grouped-matmul kernel, measured: which (block_n, k_splits) streams
the expert weights fastest, and does ``hopper_tiling``'s cost model pick it?

For the two launches of ``moe_experts`` at V4.1 shapes (fused gate+up: O=F=2304, K=D=5120, two
weights; down: O=D=5120, K=F=2304) and decode row counts, every candidate tiling runs the raw
kernel (``_hopper_gmm`` on already padded rows, the split variants including their fp32 partial
sum pass). Columns: time, GB/s over the bytes the launch must move (weights in storage format
+ rows in + rows out), ``of_copy`` (that rate over the copy bandwidth measured in this run),
``items`` (work items: row tiles x column tiles x splits; 132 SMs) and ``pick`` (the tiling the
model chooses).

    python scripts/kernel_bench/moe_gmm_tiling_sweep.py [--json FILE] [--fmts bf16,fp8] [--m 128,512]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kernel_bench.moe_gmm import D_V41, E_LOCAL, F_V41, _timeit, _weight_bytes, _weights  # noqa: E402


def _launches(key, fmt: str, ms, seed: int | None = None):
    """The two launches of ``moe_experts`` at V4.1 shapes for each row count in ``ms``, with random
    storage-format weights and uniform routing over the local experts: yields
    ``(M, keys, group sizes, launch name, O, K, weights, fused)``."""
    import jax
    import jax.numpy as jnp

    E = E_LOCAL
    kw = jax.random.split(jax.random.fold_in(key, len(fmt) if seed is None else seed), 3)
    w_up = (_weights(kw[0], fmt, E, F_V41, D_V41), _weights(kw[2], fmt, E, F_V41, D_V41))  # gate, up
    w_dn = (_weights(kw[1], fmt, E, D_V41, F_V41),)
    for M in ms:
        ks = jax.random.split(jax.random.fold_in(key, M), 3)
        idx = jax.random.randint(ks[0], (M,), 0, E)
        sizes = jnp.bincount(idx, length=E).astype(jnp.int32)
        for launch, (O, K, w, fused) in {"up": (F_V41, D_V41, w_up, True),
                                         "down": (D_V41, F_V41, w_dn, False)}.items():
            yield M, ks, sizes, launch, O, K, w, fused


def sweep(fmts=("bf16", "fp8"), ms=(128, 512), max_splits: int = 6, budget_s: float = 1e9,
          ctas=(1,)) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from deepinfer_jax.kernels_pallas import moe_gmm, tiling

    iters, repeats = 20, 5
    t_start = time.time()
    key = jax.random.PRNGKey(1)
    n_copy = 1 << 30
    big = jax.random.normal(key, (n_copy,), jnp.bfloat16)
    copy_bps = 4 * n_copy / _timeit(jax.jit(lambda a: a + 1), (big,), iters, repeats)
    del big
    print(f"copy: {copy_bps / 1e9:.0f} GB/s", flush=True)
    rows = [dict(launch="copy", fmt="-", M=0, block_n=0, k_splits=0, us=0.0, gbps=copy_bps / 1e9, of_copy=1.0)]
    E = E_LOCAL
    if "fp8mma" in fmts:
        rows += sweep_fp8_mma(ms, ctas, copy_bps, iters, repeats)
    for fmt in (f for f in fmts if f != "fp8mma"):
        for M, ks, sizes, launch, O, K, w, fused in _launches(key, fmt, ms):
            pick = moe_gmm.hopper_tiling(M, E, O, K, fmt, fused)
            bm, bk = pick.block_m, pick.block_k
            lay = tiling.aligned_layout(sizes, M, bm)
            src, valid = lay.padded_row_source()
            x = jax.random.normal(ks[1], (M, K), jnp.bfloat16)
            x_pad = jnp.where(valid[:, None], x[src], 0).astype(jnp.bfloat16)
            rw = jnp.where(valid, jax.random.uniform(ks[2], (lay.padded_rows,), jnp.float32, 0.1, 1.0), 0.0)
            wops = [moe_gmm._weight_operand(*wi, fmt, O) for wi in w]
            n_w = len(wops)
            nbytes = n_w * _weight_bytes(fmt, E, O, K) + M * (K + O) * 2
            row_tiles = int((lay.tile_group >= 0).sum())
            ref_out = None
            for bn in (64, 128, 192, 256):
                if O % bn or bm * bn * n_w > 128 * 128:
                    continue
                for splits, cps in [(s_, c_) for s_ in tiling.divisors(K // bk, max_splits) for c_ in ctas]:
                    if time.time() - t_start > budget_s:
                        print(f"budget of {budget_s:.0f} s spent: stopping the sweep", flush=True)
                        return rows
                    try:
                        stages = moe_gmm._hopper_stages(bm, bn, bk, fmt, n_w, fused, split=splits > 1,
                                                        ctas_per_sm=cps)
                    except ValueError:
                        continue
                    cfg = tiling.GmmTiling(block_m=bm, block_n=bn, block_k=bk, stages=stages,
                                           grid_tile_width=O // bn, k_splits=splits, ctas_per_sm=cps)
                    fn = jax.jit(lambda tg, xp, r, wv, cfg=cfg: moe_gmm._hopper_gmm(
                        tg, xp, list(wv), r if fused else None, fmt=fmt, n_out=O, k_in=K, cfg=cfg,
                        swiglu_limit=10.0, interpret=False))
                    args = (lay.tile_group, x_pad, rw, tuple(wops))
                    try:
                        out = fn(*args)
                        live = jnp.repeat(lay.tile_group >= 0, bm)[:, None]
                        out = jnp.where(live, out.astype(jnp.float32), 0.0)
                        if ref_out is None:
                            ref_out, err = out, 0.0
                        else:
                            err = float(jnp.linalg.norm(out - ref_out) / jnp.maximum(jnp.linalg.norm(ref_out), 1e-30))
                        t = _timeit(fn, args, iters, repeats)
                    except Exception as e:  # a tiling Mosaic rejects: keep sweeping
                        print(f"{launch} {fmt} M={M} bn={bn} S={splits} C={cps}: {type(e).__name__}: {str(e)[:200]}")
                        continue
                    is_pick = (bn, splits, cps) == (pick.block_n, pick.k_splits, pick.ctas_per_sm)
                    rows.append(dict(launch=launch, fmt=fmt, M=M, block_n=bn, k_splits=splits, ctas_per_sm=cps,
                                     stages=stages,
                                     items=row_tiles * (O // bn) * splits, us=t * 1e6, gbps=nbytes / t / 1e9,
                                     of_copy=nbytes / t / copy_bps, err_vs_first=err, pick=is_pick))
                    r = rows[-1]
                    print(f"{launch:<5} {fmt:<4} M={M:<5} bn={bn:<3} S={splits} C={cps} st={stages} items={r['items']:<5} "
                          f"{r['us']:8.1f} us {r['gbps']:6.0f} GB/s of_copy {r['of_copy']:.2f}"
                          f"{'  <- pick' if is_pick else ''}", flush=True)
    return rows


def sweep_fp8_mma(ms, ctas, copy_bps: float, iters: int, repeats: int) -> list[dict]:
    """The native fp8 ``wgmma`` kernel (``moe_gmm_fp8mma.py``) over (block_n, block_k, CTAs per
    SM), on fp8-quantized rows; ``err_vs_first`` here is against the dequantizing fp8 kernel
    (its model pick) on the same QDQ'd rows."""
    import jax
    import jax.numpy as jnp

    from deepinfer_jax.kernels_pallas import moe_gmm, moe_gmm_fp8mma, tiling
    from deepinfer_jax.base import quant

    key = jax.random.PRNGKey(1)
    E, rows = E_LOCAL, []
    for M, ks, sizes, launch, O, K, w, fused in _launches(key, "fp8", ms, seed=3):
        base = moe_gmm.hopper_tiling(M, E, O, K, "fp8", fused)
        pick = moe_gmm.fp8_mma_tiling(M, E, O, K, fused)
        bm = base.block_m
        lay = tiling.aligned_layout(sizes, M, bm)
        src, valid = lay.padded_row_source()
        x = jax.random.normal(ks[1], (M, K), jnp.bfloat16)
        q, sc = quant.act_quant_fp8_codes(x)
        xq = jnp.where(valid[:, None], q[src], jnp.zeros((), q.dtype))
        xs_T = jnp.where(valid[:, None], sc[src], 0.0).T
        x_pad = jnp.where(valid[:, None], quant.act_quant_fp8(x)[src], 0).astype(jnp.bfloat16)
        rw = jnp.where(valid, jax.random.uniform(ks[2], (lay.padded_rows,), jnp.float32, 0.1, 1.0), 0.0)
        wops = tuple(moe_gmm._weight_operand(*wi, "fp8", O) for wi in w)
        n_w = len(wops)
        nbytes = n_w * _weight_bytes("fp8", E, O, K) + M * (K + O) * 2
        row_tiles = int((lay.tile_group >= 0).sum())
        live = jnp.repeat(lay.tile_group >= 0, bm)[:, None]
        base_fn = jax.jit(lambda tg, xp, r, wv: moe_gmm._hopper_gmm(
            tg, xp, list(wv), r if fused else None, fmt="fp8", n_out=O, k_in=K, cfg=base,
            swiglu_limit=10.0, interpret=False))
        ref_out = jnp.where(live, base_fn(lay.tile_group, x_pad, rw, wops).astype(jnp.float32), 0.0)
        for bn in (64, 128):
            for bk in (128, 64):
                for cps in ctas:
                    if O % bn or moe_gmm_fp8mma.acc_registers(bm, bn, n_w) > moe_gmm.FP8_MMA_ACC_REGS:
                        continue
                    fixed = bm * bn * 2 + (bm * 4 if fused else 0) + 4096
                    budget = (moe_gmm.HOPPER_SMEM_BYTES if cps == 1
                              else moe_gmm.HOPPER_SM_SMEM_BYTES // cps - 1024)
                    try:
                        stages = tiling.pick_stages(moe_gmm_fp8mma.stage_bytes(bm, bn, bk, n_w), fixed, budget, 2, 6)
                    except ValueError:
                        continue
                    cfg = tiling.GmmTiling(block_m=bm, block_n=bn, block_k=bk, stages=stages,
                                           grid_tile_width=O // bn, ctas_per_sm=cps, fp8_mma=True)
                    fn = jax.jit(lambda tg, q_, s_, r, wv, cfg=cfg: moe_gmm_fp8mma.gmm_fp8_mma(
                        tg, q_, s_, list(wv), r if fused else None, n_out=O, k_in=K, cfg=cfg,
                        swiglu_limit=10.0, interpret=False))
                    args = (lay.tile_group, xq, xs_T, rw, wops)
                    try:
                        out = jnp.where(live, fn(*args).astype(jnp.float32), 0.0)
                        err = float(jnp.linalg.norm(out - ref_out) / jnp.maximum(jnp.linalg.norm(ref_out), 1e-30))
                        t = _timeit(fn, args, iters, repeats)
                    except Exception as e:
                        print(f"{launch} fp8mma M={M} bn={bn} bk={bk} C={cps}: {type(e).__name__}: {str(e)[:300]}")
                        continue
                    is_pick = pick is not None and (bn, bk, cps) == (pick.block_n, pick.block_k, pick.ctas_per_sm)
                    r = dict(launch=launch, fmt="fp8mma", M=M, block_n=bn, block_k=bk, k_splits=1,
                             ctas_per_sm=cps, stages=stages, items=row_tiles * (O // bn), us=t * 1e6,
                             gbps=nbytes / t / 1e9, of_copy=nbytes / t / copy_bps, err_vs_first=err,
                             pick=is_pick)
                    rows.append(r)
                    print(f"{launch:<5} fp8mma M={M:<5} bn={bn:<3} bk={bk} C={cps} st={stages} "
                          f"items={r['items']:<5} {r['us']:8.1f} us {r['gbps']:6.0f} GB/s of_copy "
                          f"{r['of_copy']:.2f} err {err:.1e}{'  <- pick' if is_pick else ''}", flush=True)
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'launch':<6} {'fmt':<6} {'M':>5} {'bn':>4} {'bk':>4} {'S':>2} {'C':>2} {'items':>6} {'us':>8} {'GB/s':>6} {'of_copy':>7} pick")
    for r in rows[1:]:
        print(f"{r['launch']:<6} {r['fmt']:<6} {r['M']:>5} {r['block_n']:>4} {r.get('block_k', ''):>4} {r['k_splits']:>2} {r['ctas_per_sm']:>2} {r['items']:>6} "
              f"{r['us']:>8.1f} {r['gbps']:>6.0f} {r['of_copy']:>7.2f} {'*' if r['pick'] else ''}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    ap.add_argument("--fmts", default="bf16,fp8", help="bf16, fp8, fp4, fp8mma (native fp8 wgmma)")
    ap.add_argument("--m", default="128,512")
    ap.add_argument("--max-splits", type=int, default=6)
    ap.add_argument("--ctas", default="1", help="CTAs per SM to try, e.g. 1,2")
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop starting new variants after this long")
    a = ap.parse_args(argv)
    import jax

    if jax.default_backend() != "gpu":
        raise SystemExit("needs a GPU (the sweep times compiled Mosaic GPU kernels)")
    t0 = time.time()
    rows = sweep(tuple(a.fmts.split(",")), tuple(int(m) for m in a.m.split(",")), a.max_splits, a.budget_s,
                 tuple(int(c) for c in a.ctas.split(",")))
    print_table(rows)
    print(f"({time.time() - t0:.0f} s)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
