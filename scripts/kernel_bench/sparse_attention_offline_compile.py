#!/usr/bin/env python3
"""Compile the sparse-attention kernel for sm_90a on a machine without a GPU (resource check).

Pallas emits the kernel's Triton module in Python; this script dumps it (with the project's
jax, the H200 described by hand) and compiles it with an upstream Triton + ptxas to report
what XLA's own Triton would roughly give: shared memory (Hopper: at most 227 KiB a block),
wgmma vs mma.sync, 16-byte cp.async gathers, registers and spills. XLA's Triton is not the
upstream one, so treat the numbers as close, not exact.

Needs a second Python with triton (kept out of the project's dependencies):
    python3 -m venv /tmp/tv && /tmp/tv/bin/pip install triton==3.9.0
    .venv/bin/python scripts/kernel_bench/sparse_attention_offline_compile.py \\
        --triton-python /tmp/tv/bin/python T H A W1,W2 [--final] [--block-h 64 --num-warps 8 --num-stages 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

_COMPILE = r'''
import glob, json, os, re, subprocess, sys
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
import triton
from triton._C.libtriton import ir
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
path, nw, ns = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
target = GPUTarget("cuda", 90, 32)
backend = CUDABackend(target)
ctx = ir.context(); ir.load_dialects(ctx); backend.load_dialects(ctx)
mod = ir.parse_mlir_module(path, ctx); mod.context = ctx
opts = backend.parse_options(dict(num_warps=nw, num_stages=ns))
mod = backend.make_ttir(mod, {}, opts, 90)  # what XLA runs first; an IR file skips it
opt_path = path[:-5] + ".opt.ttir"
open(opt_path, "w").write(str(mod))
k = triton.compile(opt_path, target=target, options=dict(num_warps=nw, num_stages=ns))
ptx = k.asm["ptx"]
ptx_path = path[:-5] + ".ptx"
open(ptx_path, "w").write(ptx)
bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
ptxas = max(glob.glob(os.path.join(bindir, "ptxas*")), key=len)  # the newest (ptxas-blackwell)
r = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", ptx_path, "-o", path[:-5] + ".cubin"],
                   capture_output=True, text=True)
regs = re.search(r"Used (\d+) registers", r.stderr)
spill = re.search(r"(\d+) bytes spill stores", r.stderr)
print(json.dumps(dict(shared=k.metadata.shared, wgmma=ptx.count("wgmma.mma_async"),
                      mma_sync=ptx.count("mma.sync"), cp_async_16B=len(re.findall(r"cp\.async\.cg\.shared\.global.*0x10", ptx)),
                      regs=int(regs.group(1)) if regs else None, spill_bytes=int(spill.group(1)) if spill else None,
                      ptxas_error=None if r.returncode == 0 else r.stderr[-300:])))
'''


def dump(T, H, A, widths, exact, kw, outdir) -> list[str]:
    """The Triton modules (one, or two for exact=False) as text files in ``outdir``."""
    import jax
    import jax.numpy as jnp
    from jax._src.pallas.triton import pallas_call_registration as reg

    from deepinfer_jax.kernels_pallas.sm90_target import jax_gpu_info, sm90_info

    jax_gpu_info().get_gpu_info = sm90_info
    mods = []
    orig = reg.lowering.lower_jaxpr_to_triton_module

    def spy(*a, **k):
        res = orig(*a, **k)
        mods.append(res.module.operation.get_asm(enable_debug_info=False))
        return res

    reg.lowering.lower_jaxpr_to_triton_module = spy
    from deepinfer_jax.kernels_pallas import sparse_attention as sa

    S = jax.ShapeDtypeStruct
    args = (S((T, H, A), jnp.bfloat16), tuple(S((4096, A), jnp.bfloat16) for _ in widths),
            tuple(S((T, w), jnp.int32) for w in widths), S((H,), jnp.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        sa.sparse_attention.trace(*args, A ** -0.5, exact, **kw).lower(lowering_platforms=("cuda",))
    paths = []
    for i, m in enumerate(mods):
        paths.append(os.path.join(outdir, f"k{i}.ttir"))
        with open(paths[-1], "w") as f:
            f.write(m)
    gen = sa._GEN_TUNING[90]
    bh = kw.get("block_h") or sa.pick_block_h(H, T, gen)
    plan = sa.block_plan(widths)
    nw, ns = sa.pick_launch(bh, A, gen, straddling=any(len(s.parts) > 1 for s in plan))
    return paths, bh, kw.get("num_warps") or nw, kw.get("num_stages") or ns


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("T", type=int)
    ap.add_argument("H", type=int)
    ap.add_argument("A", type=int)
    ap.add_argument("widths", help="index-list widths, comma separated (e.g. 128,512)")
    ap.add_argument("--final", action="store_true", help="exact=False (two kernels)")
    ap.add_argument("--block-h", type=int)
    ap.add_argument("--num-warps", type=int)
    ap.add_argument("--num-stages", type=int)
    ap.add_argument("--triton-python", default="/tmp/tv/bin/python")
    ap.add_argument("--keep", help="write the .ttir/.ptx files here")
    a = ap.parse_args(argv)
    kw = {k: v for k, v in dict(block_h=a.block_h, num_warps=a.num_warps, num_stages=a.num_stages).items() if v}
    widths = tuple(int(w) for w in a.widths.split(","))
    outdir = a.keep or tempfile.mkdtemp(prefix="sa_ttir_")
    os.makedirs(outdir, exist_ok=True)
    paths, bh, nw, ns = dump(a.T, a.H, a.A, widths, not a.final, kw, outdir)
    for p in paths:
        r = subprocess.run([a.triton_python, "-c", _COMPILE, p, str(nw), str(ns)], capture_output=True, text=True)
        res = r.stdout.strip().splitlines()[-1] if r.returncode == 0 else f"FAILED: {r.stderr[-500:]}"
        print(f"T={a.T} H={a.H} A={a.A} widths={a.widths} exact={not a.final} block_h={bh} warps={nw} "
              f"stages={ns} {os.path.basename(p)}: {res}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
