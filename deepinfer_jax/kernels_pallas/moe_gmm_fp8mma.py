"""Routed-expert grouped matmul on Hopper's native fp8 ``wgmma``, for fp8 e4m3 experts at decode.

Same op as ``moe_gmm._hopper_gmm`` with ``fmt="fp8"`` (aligned row layout, persistent CTAs,
fused gate+up with the clamped SwiGLU epilogue, or a plain projection), but the tensor core
multiplies the e4m3 codes directly instead of the warpgroup first dequantizing every weight to
bf16 (which at decode is ALU-bound: ~0.3 of copy bandwidth, slower than bf16 weights).

Both operands are e4m3 codes with power-of-two (ue8m0) scales per 32 inputs: the activations
``a[m, k] = qa[m, k] * sa[m, k/32]`` (the reference's fp8 activation QDQ, whose values these
are exactly), the weights ``w[n, k] = qw[n, k] * sw[n/32, k/32]``. So

    out[m, n] = sum_b  sa[m, b] * sw[n, b] * (sum_{k in block b} qa[m, k] * qw[n, k])

and since the scale changes every 32 inputs, each 32-wide block is one ``wgmma`` (m64 nN k32,
fp8 in, fp32 out) into a fresh accumulator that the warpgroup then *promotes*: multiplies by
the block's row scales ``sa[:, b]`` and column scales ``sw[:, b]`` and adds into the running
fp32 sum (the pipeline carry). Each block waits for its own ``wgmma`` before promoting it:
the tensor core's latency is paid per 32 inputs. (Issuing a step's blocks together and waiting
once needs one partial per block in registers; at the widths that fit, ``block_n`` 32, it
measured slower: 221 vs 168 us for the V4.1 gate+up at 512 rows.) Registers: the running sums
and one partial, ``acc_registers``. The ALU work is two operations per accumulator element per 32
inputs, i.e. ``2 * block_m / 32`` per weight element, against ~10 for the dequantizing kernel.
Measured on the H200 (V4.1 shapes, 512 rows, 2 CTAs per SM) it is still no faster than the
dequantizing kernel (gate+up 168 vs 163 us, down 80 vs 74 us): one warpgroup's serial
issue -> wait -> promote chain, ~1,200 cycles per 32-wide block, sets the pace. Hence an
explicit tiling (``moe_gmm.fp8_mma_tiling``), the starting point for a warp-specialized kernel.

Numerics: each product ``qa * qw`` is exact; Hopper sums one k32 ``wgmma`` in its fp8 adder,
which keeps fewer than fp32's mantissa bits (about 13 below the largest term, DeepSeek-V3
paper, sec. 3.3.2); promotion and the cross-block sum are fp32. The reference (bf16 operands,
fp32 accumulation) therefore differs by a few fp32-level roundings per block, far below the
bf16 rounding of the output; the device tests measure it. Interpret mode sums exactly.

Shared-memory operands: every 32-wide K block of a pipeline step is its own TMA box (32 bytes
wide, 32-byte swizzle), so each ``wgmma`` reads a whole tile (no slicing inside a swizzle atom);
the scales arrive as ``sa^T [K/32, Mp]`` (f32) and ``sw [E, K/32, O]`` (uint8 exponents,
repeated over their 32 output rows, as ``moe_gmm.prepare_scales`` lays them out).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from deepinfer_jax.kernels_pallas import gmm_common
from deepinfer_jax.kernels_pallas.tiling import GmmTiling
from deepinfer_jax.base import quant

try:
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu
except Exception:  # pragma: no cover - CPU-only builds without the GPU Pallas backend
    pl = plgpu = None

QBLOCK = 32


def acc_registers(bm: int, bn: int, n_w: int) -> int:
    """fp32 accumulator registers per thread of the warpgroup: the running sums and the
    partial of the current 32-wide block."""
    return 2 * n_w * bm * bn // 128


def stage_bytes(bm: int, bn: int, bk: int, n_w: int) -> int:
    """Shared memory of one pipeline stage: activation codes + scales, weight codes + scales."""
    nb = bk // QBLOCK
    return bm * bk + nb * bm * 4 + n_w * (bn * bk + nb * bn)


def gmm_fp8_mma(tile_group: jax.Array, xq: jax.Array, xs_T: jax.Array,
                weights: list[tuple[jax.Array, jax.Array]], route_w: jax.Array | None, *,
                n_out: int, k_in: int, cfg: GmmTiling, swiglu_limit: float, interpret: bool) -> jax.Array:
    """One launch. ``xq``: ``[Mp, K]`` e4m3 codes in the aligned layout; ``xs_T``: ``[K/32, Mp]``
    f32 scales; ``weights``: one ``(codes [E, O, K] e4m3, exponents [E, K/32, O] uint8)`` for a
    plain matmul or two (w1, w3) for the fused gate+up (then ``route_w [Mp]`` f32; the epilogue
    is ``moe_gmm``'s: the reference's roundings, clamped SwiGLU, routing weight). Returns bf16
    ``[Mp, n_out]``; rows of unused tiles (``tile_group < 0``) are unspecified."""
    bm, bn, bk, stages = cfg.block_m, cfg.block_n, cfg.block_k, cfg.stages
    n_w = len(weights)
    fused = n_w == 2
    n_tiles = tile_group.shape[0]
    mp = xq.shape[0]
    assert mp == n_tiles * bm, (mp, n_tiles, bm)
    # block_n 32 hit a misaligned-address fault on the H200 (in an earlier variant): 64k only
    if n_out % bn or k_in % bk or bk % QBLOCK or bm % 64 or bn % 64:
        raise ValueError(f"fp8 wgmma tiling: O={n_out}, K={k_in}, block_m={bm} (64k), block_n={bn} (64k), "
                         f"block_k={bk} (32k) do not divide")
    if cfg.k_splits != 1:
        raise ValueError("the fp8 wgmma kernel does not split the contraction")
    nb = bk // QBLOCK
    nk = k_in // bk
    nn = n_out // bn

    def specs(mi, ni):
        out = [plgpu.BlockSpec((bm, QBLOCK), lambda k, j=j: (mi, k * nb + j)) for j in range(nb)]
        out.append(plgpu.BlockSpec((nb, bm), lambda k: (k, mi)))
        for _ in range(n_w):
            out += [plgpu.BlockSpec((bn, QBLOCK), lambda k, j=j: (ni, k * nb + j)) for j in range(nb)]
            out.append(plgpu.BlockSpec((nb, bn), lambda k: (k, ni)))
        return out

    def step(_idx, *refs):
        *smem, accs = refs
        xq_t, xs_ref = smem[:nb], smem[nb]
        w_t, ws_ref = [], []
        pos = nb + 1
        for _ in range(n_w):
            w_t.append(smem[pos:pos + nb])
            ws_ref.append(smem[pos + nb])
            pos += nb + 1
        accs = list(accs)
        for j in range(nb):
            def mma(*tmp, j=j):
                for wi in range(n_w):
                    plgpu.wgmma(tmp[wi], xq_t[j], w_t[wi][j].T)
                return [t[...] for t in tmp]  # waits for this block's wgmmas

            parts = pl.run_scoped(mma, *[plgpu.ACC((bm, bn)) for _ in range(n_w)])
            sa = plgpu.load(xs_ref.at[j], layout=plgpu.Layout.WGMMA.reduce(1))
            for wi in range(n_w):
                sw = quant.e8m0_to_f32(plgpu.load(ws_ref[wi].at[j], layout=plgpu.Layout.WGMMA.reduce(0)))
                accs[wi] = accs[wi] + parts[wi] * sw[None, :] * sa[:, None]
        return tuple(accs)

    def kernel(*refs):
        tg_gmem, xq_gmem, xs_gmem = refs[:3]
        pos = 3
        w_gmems = []
        for _ in range(n_w):
            w_gmems.append((refs[pos], refs[pos + 1]))
            pos += 2
        rw_gmem = None
        if fused:
            rw_gmem = refs[pos]
            pos += 1
        o_gmem = refs[pos]

        @plgpu.nd_loop((n_tiles * nn,), collective_axes="sm")
        def _tile_loop(loop_info):
            lin = loop_info.index[0]
            mi, ni = lax.div(lin, jnp.int32(nn)), lax.rem(lin, jnp.int32(nn))
            g = tg_gmem[mi]

            @pl.when(g >= 0)
            def _active():
                _one_tile(mi, ni, g, xq_gmem, xs_gmem, w_gmems, rw_gmem, o_gmem)

    def _one_tile(mi, ni, g, xq_gmem, xs_gmem, w_gmems, rw_gmem, o_gmem):
        operands = [xq_gmem] * nb + [xs_gmem]
        for w_gmem, s_gmem in w_gmems:
            operands += [w_gmem.at[g]] * nb + [s_gmem.at[g]]
        zero = plgpu.layout_cast(jnp.zeros((bm, bn), jnp.float32), plgpu.Layout.WGMMA)

        def main(rw_smem=None, rw_bar=None):
            if rw_gmem is not None:
                plgpu.copy_gmem_to_smem(rw_gmem.at[pl.ds(mi * bm, bm)], rw_smem, rw_bar)
            accs = plgpu.emit_pipeline(step, grid=(nk,), in_specs=specs(mi, ni),
                                       max_concurrent_steps=max(stages, 2),
                                       init_carry=tuple(zero for _ in range(n_w)))(*operands)
            if fused:
                plgpu.barrier_wait(rw_bar)
                rw = plgpu.load(rw_smem, layout=plgpu.Layout.WGMMA.reduce(1))
                return gmm_common.swiglu_epilogue(accs[0], accs[1], rw, swiglu_limit)
            return accs[0].astype(jnp.bfloat16)

        if rw_gmem is not None:
            out = pl.run_scoped(main, rw_smem=plgpu.SMEM((bm,), jnp.float32),
                                rw_bar=plgpu.Barrier(num_arrivals=1))
        else:
            out = main()

        gmm_common.store_tile(out, o_gmem, mi * bm, ni * bn)

    args = [tile_group, xq, xs_T]
    for w, s in weights:
        args += [w, s]
    if fused:
        args.append(route_w)
    call = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((mp, n_out), jnp.bfloat16),
        grid=(gmm_common.num_sms(interpret) * cfg.ctas_per_sm,),
        grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    return call(*args)
