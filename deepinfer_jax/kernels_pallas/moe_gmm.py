"""Routed-expert grouped matmul (DeepGEMM-like) as Pallas Mosaic GPU kernels, Hopper (SM90).

Op semantics: ``moe_gmm_ref.py`` (``moe_experts_ref``); this file computes the same function.

Layout. Rows (routed tokens) are sorted by expert and each expert's run is padded up to a
multiple of ``block_m`` (``tiling.aligned_layout``), in the same gather that sorts them, so that
every row tile belongs to one expert: the kernel needs no row masks and stores whole tiles with
TMA. Padding rows are zeros and their outputs are never read back. A tile whose
``tile_group`` is ``-1`` (past the last expert) is skipped.

Kernel (one warpgroup per CTA, persistent over the SMs like the ``ragged_dot_mgpu`` example):
for each (row tile, column tile) the CTA runs a TMA pipeline over K (``stages`` deep) that
brings in the activation tile ``x[bm, bk]`` (bf16) and the weight tile in its *storage* format:

* ``bf16``: ``w[bn, bk]`` goes straight to ``wgmma`` as the transposed B operand;
* ``fp8``: ``w[bn, bk]`` e4m3 bytes plus the ue8m0 exponents ``s[bk/32, bn]``; the warpgroup
  loads the bytes from shared memory, widens them (e4m3 -> f16 -> f32, exact), multiplies by
  ``2^(s-127)`` per 32 inputs (exact), rounds to bf16 (exact) and writes the bf16 tile to a
  double-buffered shared scratch that ``wgmma`` reads;
* ``fp4``: ``w[bn, bk/2]`` packed e2m1 bytes plus ``s[bk/32, bn]``; low and high nibbles are
  decoded with integer ops (Hopper has no e2m1 conversion instruction) into two bf16 tiles
  (even and odd inputs). The activations were de-interleaved by the wrapper into
  ``[x[:, 0::2] | x[:, 1::2]]``, so the two halves are two ordinary ``wgmma``s into one
  accumulator: no nibble shuffling in registers.

Only the weight bytes and the (small) scales travel from HBM; dequantization costs shared-memory
and ALU work (done 64 weight rows at a time, overlapping the previous step's async ``wgmma``).
Measured on the H200, that ALU work, not the byte stream, sets the decode time of fp8/fp4
(one projection at 512 rows: fp8 0.38 of copy, bf16 0.93); two CTAs per SM (``ctas_per_sm``)
overlap one CTA's dequant with the other's waits (fp8 1.14-1.22x). The native fp8 ``wgmma``
variant (``moe_gmm_fp8mma.py``) trades the dequant for per-32 scale promotion and measured no
faster. Accumulation is fp32 in registers (``wgmma``).
Dequantized weights go through shared memory rather than being fed to ``wgmma`` as a register
A operand (as ``hopper_mixed_type_matmul_mgpu`` does) because Pallas' GPU interpret mode only
models shared-memory operands, and the tokens are the MMA's M side (one output layout for both
regimes); a swapped (weights-as-M, tokens-as-N) decode variant is a possible next step.

``moe_experts`` = route/sort/pad (jnp) -> fused gate+up kernel (two accumulators, the clamped
SwiGLU and the routing weight in the epilogue, bf16 out) -> fp8 activation QDQ of ``h`` in jnp
(for fp8/fp4 experts; not fused: it needs a 32-wide amax per row, see ``_qdq_h``) -> down
kernel -> gather back to ``[T, X, D]``.

Scales are re-laid out by the wrapper to ``[E, K/32, O]`` (uint8; fp8 block scales repeated
over their 32 output rows) so that one TMA box brings the exponents of a weight tile with the
output index minor. That is 1/32 (fp8) or 1/16 (fp4) of the weight bytes and is done per call;
in a serving loop it belongs at weight-load time (``prepare_scales``).

Everything here also runs on CPU in Pallas' GPU interpret mode (``interpret=True``), which
simulates shared memory, TMA, barriers and ``wgmma`` with numpy; it models ``wgmma`` as
synchronous, so the async hazards are covered only by the ``wgmma_wait`` discipline below.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from deepinfer_jax.kernels_pallas import gmm_common, tiling
from deepinfer_jax.kernels_pallas.tiling import GmmTiling
from deepinfer_jax.base import quant
from deepinfer_jax.sharding.manual import manual_axes

try:  # Mosaic GPU ships with jax; keep the module importable anywhere (the ops hook imports us)
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    _HAVE_MGPU = True
except Exception:  # pragma: no cover - CPU-only builds without the GPU Pallas backend
    pl = plgpu = None
    _HAVE_MGPU = False

QBLOCK = 32  # quantization block along the contraction dim (fp8: 32x32, fp4: 1x32)
FORMATS = ("bf16", "fp8", "fp4")

# ----------------------------------------------------------------------------- Hopper tiling
HOPPER_SMEM_BYTES = 227 * 1024  # usable dynamic shared memory per CTA on SM90 (228 KB per SM)
HOPPER_SM_SMEM_BYTES = 228 * 1024  # per SM, shared by its resident CTAs
HOPPER_NUM_SMS = gmm_common.HOPPER_NUM_SMS
HOPPER_MMA_M = 64  # wgmma: m64 per warpgroup, n in 8..256 (multiple of 8), k = 32 bytes


def hopper_tiling(m_rows: int, n_groups: int, n_out: int, k_in: int, fmt: str, fused: bool,
                  num_sms: int = HOPPER_NUM_SMS) -> GmmTiling:
    """Block sizes for one grouped matmul on Hopper (SM90).

    * ``block_m`` (rows per tile, and the group alignment): 64 when experts get <= 64 rows on
      average (decode: ``M/E`` small, the kernel is bound by streaming each weight once, and a
      64-row tile, one ``wgmma`` m64, wastes the least tensor-core work on padding rows); 128
      above (prefill: each weight tile is re-read ``M / block_m`` times, so taller tiles halve
      that traffic and keep the tensor cores fed).
    * ``block_n`` (output columns, the ``wgmma`` N), limited by the accumulator registers: one
      warpgroup holds ``block_m * block_n * n_acc / 128`` fp32 per thread (we allow 128; the
      fused gate+up kernel has two accumulators). Prefill: 128 or 64, the largest whose (row
      tile x column tile) items fill the SMs' waves to >= 80%. Decode streams each weight once
      and has few row tiles (``expected_active_tiles``: ~12 for 512 rows over 8 experts), so
      the 132 SMs' waves fill coarsely: there ``block_n`` in {256, 192, 128, 64} minimises
      ``_decode_cost`` (waves x bytes per work item). Measured on the H200 at V4.1 shapes
      (``moe_gmm_tiling_sweep.py``, 2026-11-29), the widest tile wins whenever the waves are
      equally full (down projection, 512 rows: 256 columns 0.88 of copy, 128: 0.76, 64: 0.65),
      and splitting the contraction (``k_splits``, fp32 partials + a sum pass) was slower in
      every decode case measured (e.g. 0.88 -> 0.58 at 2 splits), so it is never picked here;
      it stays available as an explicit tiling.
    * ``block_k``: one 128-byte swizzle atom of bf16 (64, i.e. four ``wgmma`` m64nNk16 steps)
      for bf16 and fp8; 128 for fp4 so
      that each nibble half (even / odd inputs) is again 64 wide. Multiples of the 32-wide
      quantization block, so a K step never splits a scale.
    * ``stages``: as deep as fits in 227 KB of shared memory after the fixed buffers (dequant
      scratch, epilogue tile), capped at 6: at decode each stage is a weight tile in flight,
      and streaming at full bandwidth needs tens of KB in flight per SM (~1 us x ~30 GB/s).
    * ``ctas_per_sm``: at decode the dequantizing formats (fp8, fp4) are ALU-bound in one
      warpgroup (the dequant of a weight tile, not its bytes, sets the pace), so two CTAs per
      SM, each with half the shared memory, let one dequantize while the other waits; used
      whenever a tiling fits in the half. Measured (H200, 512 rows, ``moe_gmm_tiling_sweep.py
      --ctas 1,2``): fp8 gate+up 186 -> 163 us, fp8 down 90 -> 74 us, fp4 down 146 -> 137 us;
      bf16, which streams, gained nothing (down: 69 us at one CTA, the best).
    * ``grid_tile_width``: at prefill the persistent CTAs sweep column tiles in groups of 8 so
      that a wave of CTAs shares few activation and weight tiles in L2; at decode the order is
      row-major (all columns of a row tile, the live tiles first) so live work is dealt evenly.

    An SM100 (Blackwell) variant would use ``tcgen05`` (128-row MMA, accumulators in TMEM,
    native e2m1/e4m3 operands with ue8m0 block scales) and different numbers here; the
    generation-independent parts are in ``tiling.py``.
    """
    if fmt not in FORMATS:
        raise ValueError(f"fmt={fmt!r}: expected one of {FORMATS}")
    bm = tiling.pick_block_m(m_rows, n_groups, HOPPER_MMA_M, (64, 128))
    n_acc = 2 if fused else 1
    bk = tiling.pick_block(k_in, (128,) if fmt == "fp4" else (64,))
    row_tiles = tiling.expected_active_tiles(m_rows, n_groups, bm)
    decode = bm == HOPPER_MMA_M
    if not decode:
        bn_cands = tuple(c for c in (128, 64) if bm * c * n_acc <= 128 * 128) or (64,)
        bn = tiling.pick_block_n(n_out, bn_cands, row_tiles, num_sms)
        stages = _hopper_stages(bm, bn, bk, fmt, n_acc, fused)
        return GmmTiling(block_m=bm, block_n=bn, block_k=bk, stages=stages,
                         grid_tile_width=min(8, n_out // bn))
    best = None
    for ctas in ((2, 1) if fmt in ("fp8", "fp4") else (1,)):
        for bn in (256, 192, 128, 64):
            if n_out % bn or bm * bn * n_acc > 128 * 128:
                continue
            try:
                stages = _hopper_stages(bm, bn, bk, fmt, n_acc, fused, ctas_per_sm=ctas)
            except ValueError:
                continue
            cost = _decode_cost(bn, row_tiles=row_tiles, n_out=n_out, k_in=k_in, bm=bm, fmt=fmt, n_acc=n_acc,
                                num_sms=num_sms * ctas)
            if best is None or cost < best[0]:
                best = (cost, bn, stages)
        if best is not None:
            break  # the most CTAs per SM that any tiling fits
    if best is None:
        raise ValueError(f"no Hopper tiling for O={n_out}, K={k_in} ({fmt}): O must be a multiple of 64")
    _, bn, stages = best
    return GmmTiling(block_m=bm, block_n=bn, block_k=bk, stages=stages, grid_tile_width=n_out // bn,
                     ctas_per_sm=ctas)


FP8_MMA_CTAS_PER_SM = 2
FP8_MMA_ACC_REGS = 128  # fp32 accumulators per thread (ptxas then used 187-254 registers in all)


def fp8_mma_tiling(m_rows: int, n_groups: int, n_out: int, k_in: int, fused: bool,
                   num_sms: int = HOPPER_NUM_SMS) -> GmmTiling | None:
    """A decode tiling of the native fp8 ``wgmma`` kernel (``moe_gmm_fp8mma.py``), or None when
    the widths do not tile. ``hopper_tiling`` never returns it: on the H200 at V4.1 decode
    shapes it measured no faster than the dequantizing kernel at two CTAs per SM (gate+up 168 vs
    163 us, down 80 vs 74 us, 512 rows; ``moe_gmm_tiling_sweep.py --fmts fp8mma``), so it is
    an explicit choice (``moe_experts(..., tiles_up=..., tiles_down=...)``) and the base for
    a warp-specialized version. Each running sum has a partial beside it
    (``moe_gmm_fp8mma.acc_registers <= FP8_MMA_ACC_REGS``); 128 inputs per step; two CTAs per
    SM (both measured best in that sweep)."""
    from deepinfer_jax.kernels_pallas import moe_gmm_fp8mma

    bm = tiling.pick_block_m(m_rows, n_groups, HOPPER_MMA_M, (64, 128))
    n_acc = 2 if fused else 1
    row_tiles = tiling.expected_active_tiles(m_rows, n_groups, bm)
    bk = 128
    if k_in % bk:
        return None
    budget = HOPPER_SM_SMEM_BYTES // FP8_MMA_CTAS_PER_SM - 1024
    best = None
    for bn in (128, 64):
        if n_out % bn or moe_gmm_fp8mma.acc_registers(bm, bn, n_acc) > FP8_MMA_ACC_REGS:
            continue
        fixed = bm * bn * 2 + (bm * 4 if fused else 0) + 4096
        try:
            stages = tiling.pick_stages(moe_gmm_fp8mma.stage_bytes(bm, bn, bk, n_acc), fixed, budget, lo=2, hi=6)
        except ValueError:
            continue
        cost = _decode_cost(bn, row_tiles=row_tiles, n_out=n_out, k_in=k_in, bm=bm, fmt="fp8", n_acc=n_acc,
                            num_sms=num_sms * FP8_MMA_CTAS_PER_SM)
        if best is None or cost < best[0]:
            best = (cost, bn, stages)
    if best is None:
        return None
    _, bn, stages = best
    return GmmTiling(block_m=bm, block_n=bn, block_k=bk, stages=stages, grid_tile_width=n_out // bn,
                     ctas_per_sm=FP8_MMA_CTAS_PER_SM, fp8_mma=True)


def _hopper_stages(bm: int, bn: int, bk: int, fmt: str, n_acc: int, fused: bool, split: bool = False,
                   ctas_per_sm: int = 1) -> int:
    """Pipeline depth that fits the shared memory next to the fixed buffers (see hopper_tiling);
    with ``ctas_per_sm`` CTAs sharing an SM, each gets that fraction of its 228 KB (1 KB of
    which the hardware reserves per CTA)."""
    stage = bm * bk * 2  # activation tile (bf16)
    fixed = bm * bn * 4 * n_acc if split else bm * bn * 2  # epilogue tile(s): fp32 partials when split
    for _ in range(n_acc):
        if fmt == "bf16":
            stage += bn * bk * 2
        else:
            stage += bn * (bk if fmt == "fp8" else bk // 2) + (bk // QBLOCK) * bn
            fixed += 2 * bn * bk * 2  # double-buffered bf16 dequant scratch
    if fused:
        fixed += bm * 4  # routing weights
    budget = HOPPER_SMEM_BYTES if ctas_per_sm == 1 else (HOPPER_SM_SMEM_BYTES // ctas_per_sm - 1024)
    return tiling.pick_stages(stage, fixed + 4096, budget, lo=2, hi=6)


_WEIGHT_BYTES = {"bf16": 2.0, "fp8": 1.0 + 1 / 32, "fp4": 0.5 + 1 / 32}  # per weight element, with scales
_ITEM_OVERHEAD_BYTES = 128 * 1024  # fill + epilogue of one work item, in bytes at one SM's share (fitted to the sweep)
_L2_READ_WEIGHT = 0.25  # an activation byte re-read from L2 costs this fraction of an HBM byte


def _decode_cost(bn: int, *, row_tiles: int, n_out: int, k_in: int, bm: int, fmt: str, n_acc: int,
                 num_sms: int) -> float:
    """Modelled time (in bytes through one SM) of a decode launch, which streams every weight
    once: the busiest SM's waves times the bytes of one work item (its weight tiles, its
    activation rows re-read from L2, a fixed fill/epilogue cost). A model to rank tilings;
    ``scripts/kernel_bench/moe_gmm_tiling_sweep.py`` measures the alternatives."""
    items = row_tiles * (n_out // bn)
    waves = tiling.cdiv(items, num_sms)
    per_item = k_in * bn * n_acc * _WEIGHT_BYTES[fmt] + _L2_READ_WEIGHT * k_in * bm * 2 + _ITEM_OVERHEAD_BYTES
    return waves * per_item


# ----------------------------------------------------------------------------- dequant helpers
def prepare_scales(scale: jax.Array | None, fmt: str, n_out: int) -> jax.Array | None:
    """Storage scales -> ``[E, K/32, O]`` uint8 exponents, output index minor (one TMA box per
    weight tile). fp8 32x32 block scales are repeated over their 32 output rows."""
    if fmt == "bf16":
        return None
    s = scale.astype(jnp.uint8)
    if fmt == "fp8":  # [E, ceil(O/32), K/32] -> [E, O, K/32]
        s = jnp.repeat(s, QBLOCK, axis=1)[:, :n_out]
    return jnp.swapaxes(s, 1, 2)


_e8m0_to_f32 = quant.e8m0_to_f32  # ue8m0 bytes -> fp32 2^(e-127): an integer shift, fine in a kernel


def _fp4_codes_to_f32(code: jax.Array) -> jax.Array:
    """4-bit e2m1 codes (int32, bit 3 = sign) -> fp32, with integer ops only.

    A magnitude code ``m = e1 e0 m0`` shifted left by 22 lands its exponent bits and its
    mantissa bit in fp32's exponent/mantissa fields; adding 126 to the exponent gives
    ``2^(e-1) * (1 + m0/2)``, the e2m1 value, for the normal codes (``m >= 2``). The two
    subnormal codes (0 and 0.5) are ``m / 2``.
    """
    mag = code & 7
    normal = lax.bitcast_convert_type((mag << 22) + (126 << 23), jnp.float32)
    sub = mag.astype(jnp.float32) * 0.5
    v = jnp.where(mag >= 2, normal, sub)
    return jnp.where(code >= 8, -v, v)


def _dequant_fp8(q: jax.Array, s_ref, bk: int) -> jax.Array:
    """e4m3 ``[bn, bk]`` (registers) with exponents ``s_ref[bk/32, bn]`` -> bf16 ``[bn, bk]``."""
    parts = []
    for j in range(bk // QBLOCK):
        scale = _e8m0_to_f32(s_ref[j, :])  # [bn]: one scale per output row for these 32 inputs
        v = q[:, j * QBLOCK:(j + 1) * QBLOCK].astype(jnp.float32) * scale[:, None]
        parts.append(v.astype(jnp.bfloat16))
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


def _dequant_fp4(p: jax.Array, s_ref, bk: int) -> tuple[jax.Array, jax.Array]:
    """Packed e2m1 ``[bn, bk/2]`` (uint8 registers) with ``s_ref[bk/32, bn]`` -> bf16 ``(even,
    odd)``, each ``[bn, bk/2]``: column ``j`` of ``even``/``odd`` is input ``2j``/``2j+1``."""
    half = QBLOCK // 2  # 16 bytes of a row share one scale
    lo_parts, hi_parts = [], []
    for j in range(bk // QBLOCK):
        scale = _e8m0_to_f32(s_ref[j, :])[:, None]
        b = p[:, j * half:(j + 1) * half].astype(jnp.int32)
        lo_parts.append((_fp4_codes_to_f32(b & 15) * scale).astype(jnp.bfloat16))
        hi_parts.append((_fp4_codes_to_f32(lax.shift_right_logical(b, 4) & 15) * scale).astype(jnp.bfloat16))
    cat = lambda xs: xs[0] if len(xs) == 1 else jnp.concatenate(xs, axis=1)
    return cat(lo_parts), cat(hi_parts)


# ----------------------------------------------------------------------------- Hopper kernel
def _hopper_gmm(tile_group: jax.Array, x: jax.Array, weights: list[tuple[jax.Array, jax.Array | None]],
                route_w: jax.Array | None, *, fmt: str, n_out: int, k_in: int, cfg: GmmTiling,
                swiglu_limit: float, interpret: bool) -> jax.Array:
    """One launch. ``x``: ``[Mp, K]`` bf16 in the aligned layout (fp4: de-interleaved);
    ``weights``: one ``(values [E, O, K or K/2], scales [E, K/32, O] or None)`` for a plain
    matmul, two (w1, w3) for the fused gate+up (``route_w [Mp]`` f32 then required).
    Returns bf16 ``[Mp, n_out]``. Rows of unused tiles (``tile_group < 0``) are unspecified.

    With ``cfg.k_splits = S > 1`` each (row tile, column tile) is S work items over K/S each,
    storing fp32 partial sums ``[S, Mp, n_w * n_out]``; the sum over S (fixed order: the result
    does not depend on scheduling), the SwiGLU epilogue and the bf16 rounding then run as one
    fused XLA pass."""
    bm, bn, bk, stages = cfg.block_m, cfg.block_n, cfg.block_k, cfg.stages
    splits = cfg.k_splits
    fused = len(weights) == 2
    n_tiles = tile_group.shape[0]
    mp = x.shape[0]
    assert mp == n_tiles * bm, (mp, n_tiles, bm)
    if n_out % bn or k_in % bk or bk % QBLOCK:
        raise ValueError(f"O={n_out}, K={k_in} must be multiples of block_n={bn}, block_k={bk} (and 32)")
    if bm % HOPPER_MMA_M or bn % 8 or (fmt != "bf16" and bn % HOPPER_MMA_M):
        raise ValueError(f"block_m={bm} must be a multiple of 64, block_n={bn} of 8 (64 for {fmt})")
    nk = k_in // bk
    nn = n_out // bn
    if nk % splits:
        raise ValueError(f"k_splits={splits} must divide the {nk} K steps (K={k_in}, block_k={bk})")
    if splits > 1 and cfg.grid_tile_width < nn:
        raise ValueError("k_splits > 1 needs the row-major item order (grid_tile_width >= O / block_n)")
    nks = nk // splits
    kx = bk // 2 if fmt == "fp4" else bk  # activation columns per wgmma operand
    wk = bk // 2 if fmt == "fp4" else bk  # weight-storage columns per step
    n_w = len(weights)

    # ---- pipeline specs: x (one or two halves), then per weight: values (+ scales)
    def specs(mi, ni, k0):
        out = [plgpu.BlockSpec((bm, kx), lambda k: (mi, k0 + k), delay_release=1)]
        if fmt == "fp4":
            out.append(plgpu.BlockSpec((bm, kx), lambda k: (mi, k0 + k + nk), delay_release=1))
        for _ in range(n_w):
            if fmt == "bf16":
                out.append(plgpu.BlockSpec((bn, wk), lambda k: (ni, k0 + k), delay_release=1))
            else:
                out.append(plgpu.BlockSpec((bn, wk), lambda k: (ni, k0 + k)))
                out.append(plgpu.BlockSpec((bk // QBLOCK, bn), lambda k: (k0 + k, ni)))
        return out

    n_xin = 2 if fmt == "fp4" else 1
    n_deq = (2 if fmt == "fp4" else 1) * n_w if fmt != "bf16" else 0
    wgmmas_per_step = n_w * n_xin

    def kernel(*refs):
        tg_gmem, x_gmem = refs[0], refs[1]
        pos = 2
        w_gmems = []
        for _ in range(n_w):
            if fmt == "bf16":
                w_gmems.append((refs[pos], None))
                pos += 1
            else:
                w_gmems.append((refs[pos], refs[pos + 1]))
                pos += 2
        rw_gmem = None
        if fused and splits == 1:
            rw_gmem = refs[pos]
            pos += 1
        o_gmem = refs[pos]

        @plgpu.nd_loop((n_tiles * nn * splits,), collective_axes="sm")
        def _tile_loop(loop_info):
            lin = loop_info.index[0]
            if cfg.grid_tile_width >= nn:  # row-major: the live row tiles (first) are dealt evenly
                mi, rest = lax.div(lin, jnp.int32(nn * splits)), lax.rem(lin, jnp.int32(nn * splits))
                ni, si = lax.div(rest, jnp.int32(splits)), lax.rem(rest, jnp.int32(splits))
            else:  # sweep column tiles in groups for L2 reuse
                mi, ni = plgpu.planar_snake(lin, (n_tiles, nn), 1, cfg.grid_tile_width)
                si = jnp.int32(0)
            g = tg_gmem[mi]

            @pl.when(g >= 0)
            def _active():
                _one_tile(mi, ni, si, g, x_gmem, w_gmems, rw_gmem, o_gmem)

    def _one_tile(mi, ni, si, g, x_gmem, w_gmems, rw_gmem, o_gmem):
        # shared-memory scratch and register accumulators are scoped separately (interpret
        # mode does not allow mixing the two memory spaces in one run_scoped)
        scoped = {}
        if n_deq:
            scoped["deq"] = [plgpu.SMEM((2, bn, kx), jnp.bfloat16) for _ in range(n_deq)]
        if rw_gmem is not None:
            scoped["rw_smem"] = plgpu.SMEM((bm,), jnp.float32)
            scoped["rw_bar"] = plgpu.Barrier(num_arrivals=1)

        def with_scratch(deq=(), rw_smem=None, rw_bar=None):
            if rw_gmem is not None:  # routing weights of this row tile, in flight during the main loop
                plgpu.copy_gmem_to_smem(rw_gmem.at[pl.ds(mi * bm, bm)], rw_smem, rw_bar)

            def step(accs, idx, *smem):
                (k,) = idx
                xs = smem[:n_xin]
                rest = smem[n_xin:]
                if fmt != "bf16":
                    # the wgmma of step k-2 read this scratch slot: it retired at the end of
                    # step k-1 (wgmma_wait below keeps at most one step in flight)
                    slot = lax.rem(k, 2)
                    b_tiles = []
                    for wi in range(n_w):
                        q_ref, s_ref = rest[2 * wi], rest[2 * wi + 1]
                        # 64 weight rows at a time (one wgmma-layout row block) bounds the
                        # registers the dequant needs next to the accumulators
                        for r in range(0, bn, HOPPER_MMA_M):
                            rows = pl.ds(r, HOPPER_MMA_M)
                            q = q_ref[rows, :]
                            s_rows = s_ref.at[:, rows]
                            if fmt == "fp8":
                                tiles = (_dequant_fp8(q, s_rows, bk),)
                            else:
                                tiles = _dequant_fp4(q, s_rows, bk)
                            for h, t in enumerate(tiles):
                                deq[wi * n_xin + h][slot, rows, :] = t
                        b_tiles += [deq[wi * n_xin + h].at[slot] for h in range(n_xin)]
                    plgpu.commit_smem()  # generic-proxy stores -> visible to wgmma
                else:
                    b_tiles = list(rest)
                for wi in range(n_w):
                    for h in range(n_xin):
                        plgpu.wgmma(accs[wi], xs[h], b_tiles[wi * n_xin + h].transpose((1, 0)))
                plgpu.wgmma_wait(wgmmas_per_step)  # step k-1's wgmmas retired: its slots can refill

            operands = [x_gmem] * n_xin
            for w_gmem, s_gmem in w_gmems:
                operands.append(w_gmem.at[g])
                if s_gmem is not None:
                    operands.append(s_gmem.at[g])

            def with_accs(*accs):
                # (emit_pipeline trims the depth to nk itself, after checking it exceeds delay_release)
                plgpu.emit_pipeline(functools.partial(step, accs), grid=(nks,), in_specs=specs(mi, ni, si * nks),
                                    max_concurrent_steps=max(stages, 2))(*operands)
                return [a[...] for a in accs]  # waits for the last wgmmas

            vals = pl.run_scoped(with_accs, *[plgpu.ACC((bm, bn)) for _ in range(n_w)])
            if splits > 1:
                return vals  # fp32 partial sums
            if fused:
                plgpu.barrier_wait(rw_bar)
                rw = plgpu.load(rw_smem, layout=plgpu.Layout.WGMMA.reduce(1))
                return gmm_common.swiglu_epilogue(vals[0], vals[1], rw, swiglu_limit)
            return vals[0].astype(jnp.bfloat16)

        out = pl.run_scoped(with_scratch, **scoped) if scoped else with_scratch()

        if splits > 1:
            @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((n_w, bm, bn), jnp.float32))
            def _store_partials(o_smem):
                for wi in range(n_w):
                    o_smem[wi] = out[wi]
                plgpu.commit_smem()
                for wi in range(n_w):
                    plgpu.copy_smem_to_gmem(o_smem.at[wi], o_gmem.at[si, pl.ds(mi * bm, bm),
                                                                     pl.ds(wi * n_out + ni * bn, bn)])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            return

        gmm_common.store_tile(out, o_gmem, mi * bm, ni * bn)

    args = [tile_group, x]
    for w, s in weights:
        args.append(w)
        if fmt != "bf16":
            args.append(s)
    if fused and splits == 1:
        args.append(route_w)
    out_type = (jax.ShapeDtypeStruct((splits, mp, n_w * n_out), jnp.float32) if splits > 1
                else jax.ShapeDtypeStruct((mp, n_out), jnp.bfloat16))
    call = plgpu.kernel(
        kernel,
        out_type=out_type,
        grid=(gmm_common.num_sms(interpret) * cfg.ctas_per_sm,),
        grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    if splits == 1:
        return call(*args)
    acc = jnp.sum(call(*args), axis=0)  # [Mp, n_w * n_out] fp32, fixed summation order
    live = jnp.repeat(tile_group >= 0, bm)[:, None]
    acc = jnp.where(live, acc, 0.0)  # rows of unused tiles were never written
    if fused:
        return gmm_common.swiglu_epilogue(acc[:, :n_out], acc[:, n_out:], route_w, swiglu_limit)
    return acc.astype(jnp.bfloat16)


# ----------------------------------------------------------------------------- wrappers
def _check_fmt(w: jax.Array, scale, fmt: str, k_in: int):
    if fmt not in FORMATS:
        raise ValueError(f"fmt={fmt!r}: expected one of {FORMATS}")
    if fmt != "bf16" and scale is None:
        raise ValueError(f"fmt={fmt!r} needs scales")
    want_k = k_in // 2 if fmt == "fp4" else k_in
    if w.shape[-1] != want_k:
        raise ValueError(f"{fmt} weights {w.shape} do not match K={k_in}")
    if k_in % QBLOCK:
        raise ValueError(f"K={k_in} must be a multiple of {QBLOCK}")


def _weight_operand(w: jax.Array, scale, fmt: str, n_out: int):
    if fmt == "fp8":
        return w.astype(jnp.float8_e4m3fn), prepare_scales(scale, fmt, n_out)
    if fmt == "fp4":
        return w.astype(jnp.uint8), prepare_scales(scale, fmt, n_out)
    return w.astype(jnp.bfloat16), None


def _deinterleave(x: jax.Array) -> jax.Array:
    """``[M, K]`` -> ``[x[:, 0::2] | x[:, 1::2]]``: the input order the fp4 kernel uses."""
    return jnp.concatenate([x[:, 0::2], x[:, 1::2]], axis=1)


def _tiles_for(m_rows, n_groups, n_out, k_in, fmt, fused, block_m, block_n, block_k, stages, k_splits=None):
    cfg = hopper_tiling(m_rows, n_groups, n_out, k_in, fmt, fused)
    bn = block_n or cfg.block_n
    splits = k_splits or cfg.k_splits
    return GmmTiling(block_m=block_m or cfg.block_m, block_n=bn, block_k=block_k or cfg.block_k,
                     stages=stages or cfg.stages,
                     grid_tile_width=n_out // bn if splits > 1 else min(cfg.grid_tile_width, n_out // bn),
                     k_splits=splits, ctas_per_sm=cfg.ctas_per_sm)


def grouped_matmul(x_MK: jax.Array, w_EOK: jax.Array, scale: jax.Array | None, group_sizes_E: jax.Array,
                   fmt: str, *, interpret: bool = False, block_m: int | None = None, block_n: int | None = None,
                   block_k: int | None = None, stages: int | None = None,
                   k_splits: int | None = None) -> jax.Array:
    """``out[r] = x[r] @ W_e^T`` for the rows ``r`` of group ``e`` (rows sorted by group, group
    ``e`` owning ``group_sizes[e]`` consecutive rows); rows past ``sum(group_sizes)`` give zeros.

    ``w_EOK``: weight values in storage format (bf16 ``[E, O, K]``; fp8 e4m3 ``[E, O, K]`` with
    ue8m0 ``scale [E, ceil(O/32), K/32]``; fp4 packed uint8 ``[E, O, K/2]`` with ue8m0
    ``scale [E, O, K/32]``). bf16 in, fp32 accumulation, bf16 ``[M, O]`` out.
    """
    M, K = x_MK.shape
    E, O = w_EOK.shape[:2]
    _check_fmt(w_EOK, scale, fmt, K)
    cfg = _tiles_for(M, E, O, K, fmt, False, block_m, block_n, block_k, stages, k_splits)
    lay = tiling.aligned_layout(group_sizes_E, M, cfg.block_m)
    src, valid = lay.padded_row_source()
    x = x_MK.astype(jnp.bfloat16)
    if fmt == "fp4":
        x = _deinterleave(x)
    x_pad = jnp.where(valid[:, None], x[src], 0).astype(jnp.bfloat16)
    y_pad = _hopper_gmm(lay.tile_group, x_pad, [_weight_operand(w_EOK, scale, fmt, O)], None, fmt=fmt,
                        n_out=O, k_in=K, cfg=cfg, swiglu_limit=0.0, interpret=interpret)
    grp = tiling.group_of_row(group_sizes_E, M)
    pos = lay.padded_position(jnp.arange(M, dtype=jnp.int32), grp)
    return jnp.where((grp >= 0)[:, None], y_pad[pos], 0).astype(jnp.bfloat16)


def _qdq_h(h: jax.Array, fmt: str) -> jax.Array:
    """fp8 QDQ of the SwiGLU output (blocks of 32 along F) before the down projection, as the
    reference does for quantized experts. In jnp between the two kernels: fusing it in the
    gate+up epilogue needs a 32-column amax per row of the accumulator (a segmented reduction
    across the wgmma register layout) and an f32 -> e4m3 -> f32 round trip; it is ~1% of the
    prefill time (one read + one write of ``h``)."""
    return quant.act_quant_fp8(h) if fmt in ("fp8", "fp4") else h


# A jit boundary of its own: every MoE layer of a step calls this with the same shapes, so JAX
# traces it once and lowers it once per step program (the lowering cache keys on the traced
# jaxpr). Inline, each layer re-ran the Mosaic GPU lowering of both kernels (its layout
# inference dominates: about 2 s per kernel launch site on a 2-core host), which made the
# lowering of a step grow with its depth.
@functools.partial(jax.jit, static_argnames=("fmt", "swiglu_limit", "n_experts", "interpret", "tiles_up",
                                             "tiles_down"))
def moe_experts(x_TD, idx_TX, weight_TX, w1, w2, w3, fmt: str, swiglu_limit: float, n_experts: int, *,
                interpret: bool = False, tiles_up: GmmTiling | None = None,
                tiles_down: GmmTiling | None = None):
    """Same signature and semantics as ``moe_gmm_ref.moe_experts_ref``: bf16 ``[T, X, D]``."""
    T, X = idx_TX.shape
    D = x_TD.shape[-1]
    w1v, w1s = w1
    w2v, w2s = w2
    w3v, w3s = w3
    E, F = w1v.shape[:2]
    _check_fmt(w1v, w1s, fmt, D)
    _check_fmt(w3v, w3s, fmt, D)
    _check_fmt(w2v, w2s, fmt, F)
    if n_experts != E:
        raise ValueError(f"n_experts={n_experts} but the weights stack {E} experts")
    quantized = fmt in ("fp8", "fp4")
    M = T * X
    a = quant.act_quant_fp8(x_TD.astype(jnp.bfloat16)) if quantized else x_TD.astype(jnp.bfloat16)

    flat_e = idx_TX.reshape(-1).astype(jnp.int32)
    in_range = (flat_e >= 0) & (flat_e < n_experts)
    key = jnp.where(in_range, flat_e, n_experts)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    sizes = jnp.bincount(key, length=n_experts + 1)[:n_experts].astype(jnp.int32)

    cfg_up = tiles_up or hopper_tiling(M, E, F, D, fmt, True)
    cfg_dn = tiles_down or hopper_tiling(M, E, D, F, fmt, False)
    if (cfg_up.fp8_mma or cfg_dn.fp8_mma) and fmt != "fp8":
        raise ValueError(f"fp8_mma tilings need fp8 experts, got fmt={fmt!r}")
    cfg_dn = dataclasses.replace(cfg_dn, block_m=cfg_up.block_m)  # both kernels share the layout
    lay = tiling.aligned_layout(sizes, M, cfg_up.block_m)
    src, valid = lay.padded_row_source()  # padded row -> sorted position
    entry = order[src]  # padded row -> flat (t, x) routing entry
    if fmt == "fp4":
        a = _deinterleave(a)
    rw_pad = jnp.where(valid, weight_TX.reshape(-1)[entry].astype(jnp.float32), 0.0)

    up_w = [_weight_operand(w1v, w1s, fmt, F), _weight_operand(w3v, w3s, fmt, F)]
    if cfg_up.fp8_mma:
        xq, xs = quant.act_quant_fp8_codes(x_TD.astype(jnp.bfloat16))
        h_pad = _fp8_mma_launch(lay, valid, entry // X, xq, xs, up_w, rw_pad, n_out=F, k_in=D, cfg=cfg_up,
                                swiglu_limit=float(swiglu_limit), interpret=interpret)
    else:
        x_pad = jnp.where(valid[:, None], a[entry // X], 0).astype(jnp.bfloat16)
        h_pad = _hopper_gmm(lay.tile_group, x_pad, up_w, rw_pad, fmt=fmt, n_out=F, k_in=D, cfg=cfg_up,
                            swiglu_limit=float(swiglu_limit), interpret=interpret)
    dn_w = [_weight_operand(w2v, w2s, fmt, D)]
    if cfg_dn.fp8_mma:
        # the QDQ of h as codes + scales; rows of unused tiles are garbage and never read
        hq, hs = quant.act_quant_fp8_codes(h_pad)  # already in the aligned layout
        y_pad = _fp8_mma_launch(lay, None, None, hq, hs, dn_w, None, n_out=D, k_in=F, cfg=cfg_dn,
                                swiglu_limit=0.0, interpret=interpret)
    else:
        h_pad = _qdq_h(h_pad, fmt)
        if fmt == "fp4":
            h_pad = _deinterleave(h_pad)
        y_pad = _hopper_gmm(lay.tile_group, h_pad, dn_w, None, fmt=fmt,
                            n_out=D, k_in=F, cfg=cfg_dn, swiglu_limit=0.0, interpret=interpret)

    # back to routing-entry order: entry j sits at sorted position inv[j]
    inv = jnp.zeros((M,), jnp.int32).at[order].set(jnp.arange(M, dtype=jnp.int32))
    pos = lay.padded_position(inv, jnp.where(in_range, flat_e, -1))
    y = jnp.where(in_range[:, None], y_pad[pos], 0).astype(jnp.bfloat16)
    return y.reshape(T, X, D)


def _fp8_mma_launch(lay, valid, row_src, q, s, weights, route_w, *, n_out, k_in, cfg, swiglu_limit, interpret):
    """Gather fp8 codes ``q [*, K]`` and scales ``s [*, K/32]`` into the aligned layout (padded
    row ``r`` takes row ``row_src[r]``, zeros where not ``valid``; ``row_src=None``: they are in
    it already) and run the fp8 ``wgmma`` kernel on them."""
    from deepinfer_jax.kernels_pallas import moe_gmm_fp8mma

    xq, xs = (q, s) if row_src is None else (q[row_src], s[row_src])
    if valid is not None:
        xq = jnp.where(valid[:, None], xq, jnp.zeros((), q.dtype))
        xs = jnp.where(valid[:, None], xs, 0.0)
    return moe_gmm_fp8mma.gmm_fp8_mma(lay.tile_group, xq, xs.T, weights, route_w, n_out=n_out, k_in=k_in,
                                      cfg=cfg, swiglu_limit=swiglu_limit, interpret=interpret)


def moe_experts_op(x_TD, idx_TX, weight_TX, w1, w2, w3, fmt: str, swiglu_limit: float, n_experts: int):
    """What ``ops.moe_experts`` runs on a GPU. One device: the kernel. Several devices: the
    kernel per device under ``shard_map`` over the local experts (``moe_ep.py``) when the step
    is traced with a context mesh of several devices (the engine's runner sets its mesh, or a
    one-device mesh, which runs the kernel directly); several devices and no context mesh run
    the partitioned reference, since GSPMD would gather every expert's weights onto every device
    for a custom call. Widths the kernel does not tile, and non-SM90 GPUs, run the reference.
    Every fallback is reported through ``ops.note_fallback``."""
    from deepinfer_jax.kernels_pallas import moe_ep, moe_gmm_ref, ops

    ref = moe_gmm_ref.moe_experts_ref
    args = (x_TD, idx_TX, weight_TX, w1, w2, w3, fmt, swiglu_limit, n_experts)
    if not is_hopper():
        ops.note_fallback("moe_experts", f"{jax.devices()[0].device_kind} is not an SM90 GPU")
        return ref(*args)
    if not shapes_supported(x_TD, idx_TX, w1, fmt, n_experts):
        ops.note_fallback("moe_experts", f"{fmt} experts of widths {tuple(w1[0].shape[1:])} are not tiled")
        return ref(*args)
    mesh = moe_ep.context_mesh()
    if mesh is not None and mesh.size > 1:
        return moe_ep.moe_experts_ep(moe_experts, *args, mesh=mesh)
    if mesh is None and jax.device_count() > 1 and not manual_axes():  # inside shard_map operands are local
        # operands may be sharded by GSPMD, which would gather every expert for a custom call
        # (the engine's runner always traces with its mesh, a one-device mesh included)
        ops.note_fallback("moe_experts", "several devices and no context mesh (jax.set_mesh)")
        return ref(*args)
    return moe_experts(*args)


def shapes_supported(x_TD, idx_TX, w1, fmt: str, n_experts: int) -> bool:
    """Whether the kernels tile these widths (they do not mask the N and K edges: e.g. the tiny
    test model's F=64 is below the fp8/fp4 block); other shapes run the reference."""
    T, X = idx_TX.shape
    D = x_TD.shape[-1]
    E, F = w1[0].shape[:2]
    try:
        hopper_tiling(T * X, E, F, D, fmt, True)
        hopper_tiling(T * X, E, D, F, fmt, False)
    except ValueError:
        return False
    return True


def is_hopper() -> bool:
    """The kernels here use ``wgmma``: SM90 only (an SM100 variant would use ``tcgen05``)."""
    try:
        return str(jax.devices()[0].compute_capability).startswith("9.")
    except Exception:
        return False


def register() -> None:
    """Plug the Hopper kernel into ``ops.moe_experts`` for platform ``gpu``. ``ops`` imports
    this module on first use on a GPU; importing it elsewhere only records the entry."""
    from deepinfer_jax.kernels_pallas import ops

    if _HAVE_MGPU:
        ops.register_kernel("moe_experts", "gpu", moe_experts_op)


register()
