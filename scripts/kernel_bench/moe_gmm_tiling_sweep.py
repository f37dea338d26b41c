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


def sweep(fmts=("bf16", "fp8"), ms=(128, 512), max_splits: int = 6, budget_s: float = 1e9) -> list[dict]:
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
    for fmt in fmts:
        kw = jax.random.split(jax.random.fold_in(key, len(fmt)), 3)
        w_up = (_weights(kw[0], fmt, E, F_V41, D_V41), _weights(kw[2], fmt, E, F_V41, D_V41))  # gate, up
        w_dn = (_weights(kw[1], fmt, E, D_V41, F_V41),)
        for M in ms:
            ks = jax.random.split(jax.random.fold_in(key, M), 3)
            idx = jax.random.randint(ks[0], (M,), 0, E)
            sizes = jnp.bincount(idx, length=E).astype(jnp.int32)
            for launch, (O, K, w, fused) in {"up": (F_V41, D_V41, w_up, True),
                                             "down": (D_V41, F_V41, w_dn, False)}.items():
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
                    for splits in tiling.divisors(K // bk, max_splits):
                        if time.time() - t_start > budget_s:
                            print(f"budget of {budget_s:.0f} s spent: stopping the sweep", flush=True)
                            return rows
                        try:
                            stages = moe_gmm._hopper_stages(bm, bn, bk, fmt, n_w, fused, split=splits > 1)
                        except ValueError:
                            continue
                        cfg = tiling.GmmTiling(block_m=bm, block_n=bn, block_k=bk, stages=stages,
                                               grid_tile_width=O // bn, k_splits=splits)
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
                            print(f"{launch} {fmt} M={M} bn={bn} S={splits}: {type(e).__name__}: {str(e)[:200]}")
                            continue
                        is_pick = (bn, splits) == (pick.block_n, pick.k_splits)
                        rows.append(dict(launch=launch, fmt=fmt, M=M, block_n=bn, k_splits=splits, stages=stages,
                                         items=row_tiles * (O // bn) * splits, us=t * 1e6, gbps=nbytes / t / 1e9,
                                         of_copy=nbytes / t / copy_bps, err_vs_first=err, pick=is_pick))
                        r = rows[-1]
                        print(f"{launch:<5} {fmt:<4} M={M:<5} bn={bn:<3} S={splits} items={r['items']:<5} "
                              f"{r['us']:8.1f} us {r['gbps']:6.0f} GB/s of_copy {r['of_copy']:.2f}"
                              f"{'  <- pick' if is_pick else ''}", flush=True)
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'launch':<6} {'fmt':<5} {'M':>5} {'bn':>4} {'S':>2} {'items':>6} {'us':>8} {'GB/s':>6} {'of_copy':>7} pick")
    for r in rows[1:]:
        print(f"{r['launch']:<6} {r['fmt']:<5} {r['M']:>5} {r['block_n']:>4} {r['k_splits']:>2} {r['items']:>6} "
              f"{r['us']:>8.1f} {r['gbps']:>6.0f} {r['of_copy']:>7.2f} {'*' if r['pick'] else ''}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    ap.add_argument("--fmts", default="bf16,fp8")
    ap.add_argument("--m", default="128,512")
    ap.add_argument("--max-splits", type=int, default=6)
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop starting new variants after this long")
    a = ap.parse_args(argv)
    import jax

    if jax.default_backend() != "gpu":
        raise SystemExit("needs a GPU (the sweep times compiled Mosaic GPU kernels)")
    t0 = time.time()
    rows = sweep(tuple(a.fmts.split(",")), tuple(int(m) for m in a.m.split(",")), a.max_splits, a.budget_s)
    print_table(rows)
    print(f"({time.time() - t0:.0f} s)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
