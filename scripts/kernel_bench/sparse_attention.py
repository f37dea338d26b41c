#!/usr/bin/env python3
"""Sparse MQA attention with sink (Pallas kernel) vs the jnp reference, against a measured copy.

V4.1 shapes: H = 64 heads, A = 512, per token a window of 128 entries (pool: ring rows of R
slots x 128 + the T fresh rows; the window of a request is its own 128 ring rows) and the top
512 of a 64k-entry compressed pool (uniform random, all valid: no locality, the worst case).
Decode: R requests x {1, 4} tokens (the tokens of a request share its window), R in {64, 256};
prefill: one request of T = 4096 tokens (window = the previous 128 fresh rows).

Rows per shape:
  kernel           ``sparse_attention`` (exact=True, the production mode), default tiling
  kernel_final     exact=False (a max pre-pass + the same kernel: reads the rows twice)
  kernel_bh{16,32,64}  exact=True with block_h forced (full run only: tuning data)
  kernel_packed    exact=True on packed pools (``kv_cache_dtype="packed"``: window rows as fp8
                   codes + scale bytes, compressed rows as fp4 codes + e4m3 scales, decoded in the
                   kernel); its ``bytes`` count the packed rows; ``err`` is against the bf16 kernel
                   on the same (decoded) values, which it must equal bit for bit
  ref_final / ref_exact  ``sparse_attention_ref`` under jit (gather [T, M, A] then einsums)
``bytes`` = the selected rows T*M*A*2 (repeats counted) + q + o (T*H*A*2 each) + indices T*M*4;
``GB/s`` = bytes / time; ``%copy`` = that over the measured copy rate (read + write of a 1 GiB
buffer); ``floor`` = max(bytes / copy rate, 4*T*H*M*A flops / measured bf16 GEMM rate);
``err`` = max|kernel - ref| / max|ref| at that shape, ref of the same mode (bf16: <= 2^-7).
Timing: compile + warm-up, then the median over 5 repeats of the mean of ``iters`` back-to-back
calls, rotating 3 input sets (different pools and indices, so that L2 does not keep the rows).

    python scripts/kernel_bench/sparse_attention.py            # all shapes + block_h sweep
    python scripts/kernel_bench/sparse_attention.py --quick    # decode 64x1, 256x1 and prefill
Needs a GPU; on CPU it runs one tiny shape in interpret mode as a smoke test.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # kernel_bench


def _timeit(fn, args_list, iters: int, repeats: int = 5) -> float:
    """Median over ``repeats`` of the mean time of ``iters`` back-to-back calls (rotating inputs)."""
    import jax

    out = None
    for a in args_list:  # compile + warm
        out = fn(*a)
    jax.block_until_ready(out)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(iters):
            out = fn(*args_list[i % len(args_list)])
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / iters)
    times.sort()
    return times[len(times) // 2]


def measure_ceilings(on_gpu: bool) -> tuple[float, float]:
    """(copy bytes/s counting read + write, bf16 GEMM flop/s), measured here."""
    import jax
    import jax.numpy as jnp

    n = (1 << 29) if on_gpu else (1 << 20)  # 1 GiB of bf16 on GPU
    xs = [jax.random.normal(jax.random.key(i), (n,), jnp.bfloat16) for i in range(2)]
    copy = jax.jit(lambda x: -x)
    t = _timeit(copy, [(x,) for x in xs], 10 if on_gpu else 1)
    copy_bps = 2 * n * 2 / t
    del xs
    m = 8192 if on_gpu else 256
    a = [jax.random.normal(jax.random.key(10 + i), (m, m), jnp.bfloat16) for i in range(2)]
    mm = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    t = _timeit(mm, [(a[0], a[1]), (a[1], a[0])], 10 if on_gpu else 1)
    return copy_bps, 2.0 * m ** 3 / t


def _make_inputs(key, R: int, tpr: int, H: int, A: int, W: int, K: int, N: int, prefill: bool):
    """One input set: q, (window pool, compressed pool), (window idx, top-k idx), sink."""
    import jax
    import jax.numpy as jnp

    T = R * tpr
    ks = jax.random.split(key, 5)
    q = jax.random.normal(ks[0], (T, H, A), jnp.bfloat16)
    ring = R * W if not prefill else W  # prefill: one request, its (empty) ring + fresh rows
    win = jax.random.normal(ks[1], (ring + T, A), jnp.bfloat16)
    comp = jax.random.normal(ks[2], (N, A), jnp.bfloat16)
    if prefill:  # token t: fresh rows t-127 .. t (before 0: -1)
        p = jnp.arange(T)[:, None] - (W - 1) + jnp.arange(W)[None, :]
        widx = jnp.where(p >= 0, ring + p, -1).astype(jnp.int32)
    else:  # token of request r: its 128 ring rows (rotated), the newest tpr of them fresh
        r = jnp.arange(T) // tpr
        j = jnp.arange(T) % tpr
        ring_i = r[:, None] * W + (jnp.arange(W)[None, :] + j[:, None]) % W
        fresh = jnp.arange(W)[None, :] >= W - 1 - j[:, None]
        fresh_i = ring + r[:, None] * tpr + (jnp.arange(W)[None, :] - (W - 1 - j[:, None]))
        widx = jnp.where(fresh, fresh_i, ring_i).astype(jnp.int32)
    cidx = jax.random.randint(ks[3], (T, K), 0, N, jnp.int32)
    sink = jax.random.normal(ks[4], (H,), jnp.float32)
    return q, (win, comp), (widx, cidx), sink


def bench(quick: bool = False) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from deepinfer_jax.base import kv_codes
    from deepinfer_jax.kernels_pallas import sparse_attention as S
    from deepinfer_jax.kernels_pallas.sparse_attention_ref import sparse_attention_ref

    on_gpu = jax.default_backend() == "gpu"
    interp = not on_gpu
    H, A, W, K, N = 64, 512, 128, 512, 65536
    if on_gpu:
        shapes = [(64, 1, False), (256, 1, False), (1, 4096, True)]
        if not quick:
            shapes = [(64, 1, False), (64, 4, False), (256, 1, False), (256, 4, False), (1, 4096, True)]
    else:  # smoke test only
        shapes, H, A, W, K, N = [(2, 1, False)], 16, 64, 64, 64, 1024
    copy_bps, mm_flops = measure_ceilings(on_gpu)
    print(f"copy {copy_bps / 1e9:.0f} GB/s (read + write), bf16 GEMM {mm_flops / 1e12:.0f} TFLOP/s", flush=True)
    scale = A ** -0.5
    rows: list[dict] = []
    for R, tpr, prefill in shapes:
        T, M = R * tpr, W + K
        sets = [_make_inputs(jax.random.key(100 * T + i), R, tpr, H, A, W, K, N, prefill) for i in range(3)]
        packed = [(q, (kv_codes.pack_window(w), kv_codes.pack_comp(c)), i, sk) for q, (w, c), i, sk in sets]
        # the bf16 kernel's inputs hold the packed values, so the two kernels must agree exactly
        sets = [(q, tuple(kv_codes.unpack(p) for p in pp), i, sk) for q, pp, i, sk in packed]
        jax.block_until_ready((sets, packed))
        nbytes = T * M * A * 2 + 2 * T * H * A * 2 + T * M * 4
        packed_bytes = T * (W * (A + A // 32) + K * (A // 2 + A // 16)) + 2 * T * H * A * 2 + T * M * 4
        flops = 4.0 * T * H * M * A
        floor = max(nbytes / copy_bps, flops / mm_flops)

        def kern(exact, **kw):
            return jax.jit(lambda q, p, i, s: S.sparse_attention(q, p, i, s, scale, exact, interpret=interp, **kw))

        variants = {"kernel": kern(True), "kernel_packed": kern(True), "kernel_final": kern(False)}
        if not quick and on_gpu:
            for bh in (16, 32, 64):
                variants[f"kernel_bh{bh}"] = kern(True, block_h=bh)
        variants["ref_final"] = jax.jit(lambda q, p, i, s: sparse_attention_ref(q, p, i, s, scale, False))
        variants["ref_exact"] = jax.jit(lambda q, p, i, s: sparse_attention_ref(q, p, i, s, scale, True))

        refs = {ex: np.asarray(variants["ref_exact" if ex else "ref_final"](*sets[0]), np.float32)
                for ex in (True, False)}
        gen = S._gen_tuning()
        bh0 = S.pick_block_h(H, T, gen)
        iters = (20 if T <= 1024 else 5) if on_gpu else 1
        plain_out = None
        for name, fn in variants.items():
            is_packed = name == "kernel_packed"
            args, nb = (packed, packed_bytes) if is_packed else (sets, nbytes)
            fl = max(nb / copy_bps, flops / mm_flops)
            row = dict(T=T, R=R, tpr=tpr, H=H, A=A, M=M, case=name, bytes=nb, flops=flops,
                       floor_us=fl * 1e6)
            try:
                if name.startswith("kernel"):
                    out = np.asarray(fn(*args[0]), np.float32)
                    ref = refs[name != "kernel_final"]
                    if is_packed and plain_out is not None:
                        ref = plain_out
                        row["bit_identical"] = bool(np.array_equal(out, plain_out))
                    if name == "kernel":
                        plain_out = out
                    row["err"] = float(np.abs(out - ref).max() / np.abs(ref).max())
                    row["block_h"] = int(name[len("kernel_bh"):]) if name.startswith("kernel_bh") else bh0
                    row["launch"] = S.pick_launch(row["block_h"], A, gen)
                t = _timeit(fn, args, iters if name.startswith("kernel") else max(1, iters // 4))
                row.update(us=t * 1e6, gbps=nb / t / 1e9, of_copy=nb / t / copy_bps,
                           of_floor=fl / t)
            except Exception as e:  # a variant that does not compile (e.g. out of shared memory)
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            rows.append(row)
            print(_fmt(row), flush=True)
        del sets
    return rows


_HDR = (f"{'T':>5} {'RxTok':>7} {'case':<13} {'us':>9} {'GB/s':>7} {'%copy':>6} {'floor_us':>9} "
        f"{'%floor':>7} {'bh':>3} {'err':>8}")


def _fmt(r: dict) -> str:
    head = f"{r['T']:>5} {str(r['R']) + 'x' + str(r['tpr']):>7} {r['case']:<13}"
    if "error" in r:
        return f"{head} ERROR {r['error']}"
    err = f"{r['err']:.2e}" if "err" in r else ""
    return (f"{head} {r['us']:>9.1f} {r['gbps']:>7.0f} {100 * r['of_copy']:>5.0f}% {r['floor_us']:>9.1f} "
            f"{100 * r['of_floor']:>6.0f}% {r.get('block_h', ''):>3} {err:>8}")


def print_table(rows: list[dict]) -> None:
    print(_HDR)
    for r in rows:
        print(_fmt(r))


def main(argv=None) -> int:
    from kernel_bench import standalone_main

    return standalone_main(__doc__, bench, print_table, argv)


if __name__ == "__main__":
    sys.exit(main())
