#!/usr/bin/env python3
"""MoE grouped matmul (Pallas Mosaic GPU, ``kernels_pallas/moe_gmm.py``) vs baselines.

Shapes: DeepSeek-V4.1 routed experts, D=5120, F=2304, 8 local experts; ``M`` = routed rows that
land on this shard (top-6 over 384 experts restricted to the 8 local ones, so we use the row
count directly: ``T = M`` tokens with one local slot each, experts drawn uniformly). Decode
M in {128, 512, 2048}, prefill M in {12288, 32768}; weight formats bf16 / fp8 / fp4.

Rows (op):
  moe_experts      ours, the whole op (route/pad glue + gate+up kernel + h QDQ + down kernel)
  moe_ref          the jnp reference (``moe_experts_ref``: dequantize, ragged_dot x3), what the
                   model runs without the kernel
  gmm              ours, ``grouped_matmul`` of one projection ``x[M, D] @ w1^T -> [M, F]``
                   (includes the pad/unpad gathers)
  gmm_kernel       the same kernel call alone on already padded rows
  ragged_dot_bf16  baseline (a): ``jax.lax.ragged_dot`` of the same projection with the weights
                   already dequantized to bf16
  dense_bf16       baseline (b): equal groups ``[E, M/E, D] x [E, D, F]`` einsum in bf16, the
                   dense matmul rate of the same total shape
  copy             baseline (c): ``x + 1`` over a 2 GiB bf16 array (bytes read + written)

Columns: ``time_us`` (median over repeats of the mean of back-to-back calls), ``TFLOP/s``
(2*M*D*F per projection, real rows only), ``GB/s`` (bytes the op must move at least: weights in
storage format with scales + activations in + outputs out), ``ratio`` (prefill: TFLOP/s over
dense_bf16's; decode: GB/s over copy's), ``flop_floor_us`` / ``byte_floor_us`` (FLOPs at
700 TFLOP/s, bytes at 4.0 TB/s: the H200's bf16 GEMM and copy rates), ``rel_err`` (ours vs
the reference on the same inputs, relative Frobenius).

    python scripts/kernel_bench/moe_gmm.py            # all sizes and formats
    python scripts/kernel_bench/moe_gmm.py --quick    # M in {512, 12288}
    python scripts/kernel_bench/moe_gmm.py --json rows.json
Needs a GPU; on CPU it runs one tiny interpret-mode size as a smoke test.
"""

from __future__ import annotations

import os
import sys
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # kernel_bench

from kernel_bench import back_to_back_time as _timeit  # noqa: E402
from kernel_bench import copy_rate  # noqa: E402

HBM_BPS = 4.0e12  # H200 measured copy bandwidth (read + write)
MMA_FLOPS = 700e12  # H200 bf16 dense GEMM rate
D_V41, F_V41, E_LOCAL = 5120, 2304, 8
DECODE_M = (128, 512, 2048)
PREFILL_M = (12288, 32768)


def _weights(key, fmt: str, E: int, O: int, K: int):
    """Random stacked weights in storage format (every e4m3 / e2m1 code valid, never zero)."""
    import jax
    import jax.numpy as jnp

    k1, k2 = jax.random.split(key)
    if fmt == "bf16":
        return (jax.random.normal(k1, (E, O, K), jnp.float32) * K ** -0.5).astype(jnp.bfloat16), None
    if fmt == "fp8":
        w = jax.random.normal(k1, (E, O, K), jnp.float32).astype(jnp.float8_e4m3fn)
        s = jax.random.randint(k2, (E, -(-O // 32), K // 32), 117, 121).astype(jnp.uint8)
        return w, s
    w = jax.random.randint(k1, (E, O, K // 2), 0, 256).astype(jnp.uint8)
    s = jax.random.randint(k2, (E, O, K // 32), 118, 122).astype(jnp.uint8)
    return w, s


def _weight_bytes(fmt: str, E: int, O: int, K: int) -> int:
    if fmt == "bf16":
        return E * O * K * 2
    if fmt == "fp8":
        return E * O * K + E * (-(-O // 32)) * (K // 32)
    return E * O * K // 2 + E * O * (K // 32)


def _rel(a, b) -> float:
    import jax.numpy as jnp

    a = a.astype(jnp.float32)
    b = b.astype(jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def bench(quick: bool = False) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from deepinfer_jax.kernels_pallas import moe_gmm, moe_gmm_ref, tiling

    on_gpu = jax.default_backend() == "gpu"
    interp = not on_gpu
    if on_gpu:
        D, F, E = D_V41, F_V41, E_LOCAL
        sizes = (512, 12288) if quick else DECODE_M + PREFILL_M
        fmts = ("bf16", "fp8", "fp4")
        iters, repeats = 20, 5
    else:  # smoke test of the script itself
        D, F, E = 256, 128, 4
        sizes, fmts, iters, repeats = (64,), ("fp8",), 1, 1
    limit = 10.0
    rows: list[dict] = []
    key = jax.random.PRNGKey(0)

    # (c) copy bandwidth, measured in this run
    n_copy = (1 << 30) if on_gpu else (1 << 20)  # bf16 elements: 2 GiB on the GPU
    t_copy, copy_bps = copy_rate(n_copy, iters, repeats)
    rows.append(dict(op="copy", fmt="-", M=0, time_us=t_copy * 1e6, tflops=0.0, gbps=copy_bps / 1e9, ratio=1.0,
                     flop_floor_us=0.0, byte_floor_us=2 * n_copy * 2 / HBM_BPS * 1e6, rel_err=0.0))
    print(f"copy: {copy_bps / 1e9:.0f} GB/s", flush=True)

    for M in sizes:
        prefill = M >= 4096
        ks = jax.random.split(jax.random.fold_in(key, M), 8)
        x = jax.random.normal(ks[0], (M, D), jnp.bfloat16)
        idx = jax.random.randint(ks[1], (M, 1), 0, E).astype(jnp.int32)
        wt = jax.random.uniform(ks[2], (M, 1), jnp.float32, 0.1, 1.0)
        sizes_e = jnp.bincount(idx[:, 0], length=E).astype(jnp.int32)
        order = jnp.argsort(idx[:, 0], stable=True)
        xs = x[order]  # rows sorted by expert (for the single-projection rows)
        flops1 = 2.0 * M * D * F

        # (b) dense bf16, equal groups of the same total shape
        mg = max(M // E, 1)
        xd = jax.random.normal(ks[3], (E, mg, D), jnp.bfloat16)
        wd = (jax.random.normal(ks[4], (E, D, F), jnp.float32) * D ** -0.5).astype(jnp.bfloat16)
        t_dense = _timeit(jax.jit(lambda a, b: jnp.einsum("emk,ekn->emn", a, b,
                                                          preferred_element_type=jnp.float32).astype(jnp.bfloat16)),
                          (xd, wd), iters, repeats)
        dense_tflops = 2.0 * E * mg * D * F / t_dense / 1e12
        del xd, wd
        dense_bytes = E * D * F * 2 + E * mg * (D + F) * 2
        rows.append(dict(op="dense_bf16", fmt="bf16", M=M, time_us=t_dense * 1e6, tflops=dense_tflops,
                         gbps=dense_bytes / t_dense / 1e9, ratio=1.0 if prefill else dense_bytes / t_dense / copy_bps,
                         flop_floor_us=2.0 * E * mg * D * F / MMA_FLOPS * 1e6,
                         byte_floor_us=dense_bytes / HBM_BPS * 1e6, rel_err=0.0))

        def add(op, fmt, t, flops, nbytes, err):
            rows.append(dict(op=op, fmt=fmt, M=M, time_us=t * 1e6, tflops=flops / t / 1e12, gbps=nbytes / t / 1e9,
                             ratio=(flops / t / 1e12) / dense_tflops if prefill else (nbytes / t) / copy_bps,
                             flop_floor_us=flops / MMA_FLOPS * 1e6, byte_floor_us=nbytes / HBM_BPS * 1e6,
                             rel_err=err))
            r = rows[-1]
            print(f"M={M:>6} {fmt:<4} {op:<16} {r['time_us']:>10.1f} us {r['tflops']:>7.1f} TFLOP/s "
                  f"{r['gbps']:>7.0f} GB/s ratio {r['ratio']:.2f} err {err:.1e}", flush=True)

        def err_row(op, fmt, e):
            print(f"M={M} {fmt} {op}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
            traceback.print_exc(limit=3)
            rows.append(dict(op=op, fmt=fmt, M=M, time_us=float("nan"), tflops=float("nan"), gbps=float("nan"),
                             ratio=float("nan"), flop_floor_us=0.0, byte_floor_us=0.0, rel_err=float("nan"),
                             error=f"{type(e).__name__}: {str(e)[:400]}"))

        for fi, fmt in enumerate(fmts):
            kw = jax.random.split(ks[5 + fi % 3], 3)
            w1, w2, w3 = _weights(kw[0], fmt, E, F, D), _weights(kw[1], fmt, E, D, F), _weights(kw[2], fmt, E, F, D)
            wb1 = _weight_bytes(fmt, E, F, D)
            moe_bytes = 3 * wb1 + M * D * 2 * 2  # three weights + x in + y out
            gmm_bytes = wb1 + M * (D + F) * 2

            ref_fn = jax.jit(lambda x, i, w, a, b, c: moe_gmm_ref.moe_experts_ref(x, i, w, a, b, c, fmt, limit, E))
            y_ref = ref_fn(x, idx, wt, w1, w2, w3)
            t = _timeit(ref_fn, (x, idx, wt, w1, w2, w3), max(iters // 4, 1), repeats)
            add("moe_ref", fmt, t, 3 * flops1, moe_bytes, 0.0)
            try:
                ours = jax.jit(lambda x, i, w, a, b, c: moe_gmm.moe_experts(x, i, w, a, b, c, fmt, limit, E,
                                                                            interpret=interp))
                err = _rel(ours(x, idx, wt, w1, w2, w3), y_ref)
                t = _timeit(ours, (x, idx, wt, w1, w2, w3), iters, repeats)
                add("moe_experts", fmt, t, 3 * flops1, moe_bytes, err)
            except Exception as e:  # keep the baselines when a kernel does not compile
                err_row("moe_experts", fmt, e)
            del y_ref

            # one projection: x[M, D] @ w1^T
            W1 = moe_gmm_ref.dequant_experts(*w1, fmt)
            rd = jax.jit(lambda a, w, g: jax.lax.ragged_dot(a, jnp.swapaxes(w, 1, 2), g,
                                                            preferred_element_type=jnp.float32).astype(jnp.bfloat16))
            g_ref = rd(xs, W1, sizes_e)
            t = _timeit(rd, (xs, W1, sizes_e), iters, repeats)
            add("ragged_dot_bf16", "bf16", t, flops1, E * F * D * 2 + M * (D + F) * 2, 0.0)
            del W1
            try:
                gmm = jax.jit(lambda a, w, s, g: moe_gmm.grouped_matmul(a, w, s, g, fmt, interpret=interp))
                err = _rel(gmm(xs, *w1, sizes_e), g_ref)
                t = _timeit(gmm, (xs, *w1, sizes_e), iters, repeats)
                add("gmm", fmt, t, flops1, gmm_bytes, err)

                cfg = moe_gmm.hopper_tiling(M, E, F, D, fmt, False)
                lay = tiling.aligned_layout(sizes_e, M, cfg.block_m)
                src, valid = lay.padded_row_source()
                xa = moe_gmm._deinterleave(xs) if fmt == "fp4" else xs
                x_pad = jnp.where(valid[:, None], xa[src], 0).astype(jnp.bfloat16)
                wop = moe_gmm._weight_operand(*w1, fmt, F)
                kern = jax.jit(lambda tg, xp, wv, ws: moe_gmm._hopper_gmm(
                    tg, xp, [(wv, ws)], None, fmt=fmt, n_out=F, k_in=D, cfg=cfg, swiglu_limit=0.0, interpret=interp))
                t = _timeit(kern, (lay.tile_group, x_pad, *wop), iters, repeats)
                add("gmm_kernel", fmt, t, flops1, gmm_bytes, err)
            except Exception as e:
                err_row("gmm", fmt, e)
            del w1, w2, w3, g_ref
    return rows


def print_table(rows: list[dict]) -> None:
    hdr = (f"{'op':<16} {'fmt':<5} {'M':>6} {'time_us':>10} {'TFLOP/s':>8} {'GB/s':>7} {'ratio':>6} "
           f"{'flop_floor':>10} {'byte_floor':>10} {'rel_err':>8}")
    print(hdr)
    for r in rows:
        print(f"{r['op']:<16} {r['fmt']:<5} {r['M']:>6} {r['time_us']:>10.1f} {r['tflops']:>8.1f} {r['gbps']:>7.0f} "
              f"{r['ratio']:>6.2f} {r['flop_floor_us']:>10.1f} {r['byte_floor_us']:>10.1f} {r['rel_err']:>8.1e}"
              + (f"  {r['error'][:60]}" if "error" in r else ""))


def main(argv=None) -> int:
    from kernel_bench import standalone_main

    return standalone_main(__doc__, bench, print_table, argv)


if __name__ == "__main__":
    sys.exit(main())
