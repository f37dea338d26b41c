"""Sparse MQA attention with an attention sink: Pallas GPU kernel (Triton lowering).

Same function and rounding as :func:`sparse_attention_ref.sparse_attention_ref` (read its
docstring first): every token ``t`` attends, with all its heads, to the entries of one or more
KV pools named by its index lists (``-1`` = unused), one latent per entry used as key and value.

Kernel (one program per (token, block of ``block_h`` heads)):

* heads are the matmul M dimension: ``S[Hb, 64] = q[Hb, A] . KV[64, A]^T``, then
  ``O[Hb, A] += bf16(P)[Hb, 64] . KV[64, A]`` with fp32 accumulation (tensor cores);
* the 64 entries of a block are gathered row by row straight from the pools in HBM (a pointer
  gather ``pool[idx[:, None], cols[None, :]]``: 64 rows x A contiguous bf16, 16-byte vector
  loads; ``-1`` rows are masked out of the load and read as zeros). The loop over blocks is
  software-pipelined by Triton (``num_stages``), so the gathers of block b+1 are in flight while
  block b is in the tensor cores;
* online softmax over blocks of exactly 64 entries of the concatenated index list (pool 0's
  list, then pool 1's, ...), probabilities rounded to bf16 relative to the running max before
  PV, denominator from the fp32 probabilities: the reference's ``exact=True`` rounding. The
  pools are never concatenated in HBM: a block lying inside one pool reads only that pool; a
  block straddling two pools (only when a list width is not a multiple of 64) gathers from both
  with complementary masks into one tile. Every segment of blocks is its own loop whose end is
  read from a tiny input array: with static ends Triton folds one-block loops into straight
  code, whose tiles then sat next to the loops' pipeline buffers (320 KiB: does not fit);
* ``exact=False`` (rounding relative to the *final* max) runs a first pass that computes the
  final max per (token, head) (QK only), then the same kernel started from that max: the
  running max then never moves, which is exactly the reference's one-pass rounding. It reads
  the gathered rows twice: ``exact=True`` is the production mode and the cheaper one here.

Why the Triton lowering and not Mosaic GPU (jax 0.11.2): the data-dependent row gather is the
heart of this kernel. Mosaic GPU's gathered copies are TMA ``gather4`` (sm_100, Blackwell only),
its ``cp.async`` implementation rejects gathers, and the remaining route, one single-row TMA per
entry (64 a block, issued by one thread) into a tiled + swizzled wgmma operand, has no example
in jax and would also need the 64 x 512 fp32 accumulator split over two warpgroups by hand.
The Triton lowering gathers with plain pointer arithmetic (vectorised, pipelined with
``cp.async`` by Triton), picks wgmma on sm_90 and splits the accumulator itself. jax 0.11.2
marks the Pallas Triton backend deprecated (a DeprecationWarning at lowering time, no error);
revisit with Mosaic GPU once Hopper gathers are expressible there.

Checked offline (no GPU): the Triton module Pallas emits, compiled for sm_90a by Triton 3.9 +
ptxas 13.4: at H = 64, A = 512 (block_h 64, 8 warps, 2 stages) 193 KiB shared memory, wgmma,
16-byte ``cp.async`` gathers, 255 registers with ~170 B of spills; block_h 32 / 16 use mma.sync
with 100 / 82 KiB and no spills. XLA's own Triton may differ somewhat.

Packed pools (``kv_codes.PackedPool``, ``kv_cache_dtype="packed"``): the row gather reads the
codes and the scales of the 64 entries (fp8 window entries: A + A/32 bytes a row; fp4 compressed
entries: A/2 + A/16) and decodes them in registers with integer ops and a bitcast to f32 (exact,
as ``kv_codes.unpack``) into the same bf16 tile; the e4m3 codes and scales travel as uint8. The
decode sits between the loads and the MMAs, off the pipelined row-copy path the bf16 tile takes:
fewer bytes but more time per step than bf16 pools on Hopper (measured in
``benchmarks/results/device_check_H100_2026-12-06/``), so packed caches are for capacity.

Shapes: ``block_h`` and ``A`` must be powers of two >= 16 (Triton tensor sizes); H is padded up
to a multiple of ``block_h`` (any H >= 1 works; H >= 16 per device avoids wasted MMA rows).
Stacking several tokens into the M dimension is valid only for tokens with the same index lists
and is not done. Indices must lie in ``[-1, N_i)``; larger ones are clamped to ``N_i - 1`` (a
memory-safety guard only: the reference would give NaN there).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from deepinfer_jax.base import kv_codes
from deepinfer_jax.kernels_pallas import tiling
from deepinfer_jax.kernels_pallas.sparse_attention_ref import BLOCK as _REF_BLOCK

BLOCK = 64  # entries per online-softmax step: must equal the reference kernel's block
assert BLOCK == _REF_BLOCK
_M_FLOOR = -1e30  # running-max floor, as the reference (rows with no valid entry give 0)


# ----------------------------------------------------------------------------------------------
# Tiling: the generation-independent helpers are in tiling.py; the chip numbers are here.
# ----------------------------------------------------------------------------------------------
Segment = tiling.Segment


def block_plan(widths: tuple[int, ...]) -> tuple[Segment, ...]:
    return tiling.block_plan(widths, BLOCK)


@dataclasses.dataclass(frozen=True)
class GenTuning:
    """What differs between GPU generations: SM count and shared memory per block."""

    sm_count: int
    smem_bytes: int


# Generation-specific numbers live here only (compute capability -> tuning).
_GEN_TUNING = {
    90: GenTuning(sm_count=132, smem_bytes=227 * 1024),  # Hopper H100/H200 SXM
}
_DEFAULT_GEN = 90


def _gen_tuning() -> GenTuning:
    cc = _DEFAULT_GEN
    try:
        dev = jax.devices()[0]
        if dev.platform == "gpu":
            major, minor = str(dev.compute_capability).split(".")
            cc = int(major) * 10 + int(minor)
    except Exception:  # CPU, interpret mode, unknown device: Hopper numbers
        pass
    return _GEN_TUNING.get(cc, _GEN_TUNING[_DEFAULT_GEN])


def pick_block_h(H: int, T: int, gen: GenTuning) -> int:
    """Heads per program: 64 (one wgmma M tile), fewer when 64 would leave most SMs idle."""
    return tiling.pick_heads_per_program(H, T, gen.sm_count)


def pick_launch(block_h: int, A: int, gen: GenTuning, straddling: bool = False) -> tuple[int, int]:
    """(num_warps, num_stages) on Hopper. 8 warps once the fp32 accumulator has >= 16K elements
    (<= 128 registers a thread for it at 64 x 512; 32 x 512 with 4 warps spilled, Triton 3.9
    offline compile). Stages: as many gather stages as fit next to the q tile in shared memory
    with 32 KiB left for Triton's scratch, at most 3, except at A = 512 where the launch sweep
    (``scripts/kernel_bench/triton_launch_sweep.py``, H200, V4.1 decode; results in
    ``benchmarks/results/triton_launch_sweep_NVIDIA_H200.json``) measured: block_h 64 -> 3 stages
    (256 requests: 123.5 us vs 132.7 at 2; 64 requests 66.7 vs 73.8), block_h 32 -> 2 stages
    (64 requests: 58.1 us vs 67.7 at 3); 16 warps were slower everywhere. Triton shares buffers
    that the byte estimate counts twice, so 3 stages of 64 x 512 fit although it predicts 2.
    A plan with a block straddling two pools (index-list widths not multiples of 64; never at
    V4.1 shapes) runs unpipelined: its loops' stage buffers did not all share memory (up to 224
    KiB of the 227 at A = 512)."""
    num_warps = 8 if block_h * A >= 16384 else 4
    if straddling:
        return num_warps, 1
    if A == 512 and block_h in (32, 64):
        return num_warps, 3 if block_h == 64 else 2
    stages = tiling.pick_stages(bytes_per_stage=BLOCK * A * 2, fixed_bytes=block_h * A * 2 + 32 * 1024,
                                budget_bytes=gen.smem_bytes, lo=1, hi=3)
    return num_warps, stages


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------
def _gather(pool_ref, idx, ok, A: int, other):
    """``[BLOCK, A]`` rows ``pool[idx]`` where ``ok``, ``other`` elsewhere (no memory access
    there: the load is predicated off)."""
    n_rows = pool_ref.shape[0]
    safe = jnp.minimum(jnp.where(ok, idx, 0), n_rows - 1)
    cols = jnp.arange(A, dtype=jnp.int32)
    return plgpu.load(pool_ref.at[safe[:, None], cols[None, :]], mask=ok[:, None], other=other)


def _gather_bytes(ref, idx, ok, width: int):
    """``[BLOCK, width]`` int32 bytes of rows ``ref[idx]`` (uint8 ref; 0 where not ``ok``):
    contiguous row loads, vectorised as the bf16 gather's."""
    safe = jnp.minimum(jnp.where(ok, idx, 0), ref.shape[0] - 1)
    cols = jnp.arange(width, dtype=jnp.int32)
    b = plgpu.load(ref.at[safe[:, None], cols[None, :]], mask=ok[:, None], other=0)
    return b.astype(jnp.int32) & 0xFF


def _expand(s_BG, block: int):
    """``[BLOCK, G]`` per-group values -> ``[BLOCK, G * block]`` (each repeated ``block`` times),
    in registers: a per-column gather of the scale bytes cost one byte load per element."""
    n, g = s_BG.shape
    return jnp.broadcast_to(s_BG[:, :, None], (n, g, block)).reshape(n, g * block)


def decode_e4m3(b):
    """e4m3fn bytes (int32 0..255) -> f32 values (exact; no NaN code is ever stored)."""
    e, m = (b >> 3) & 15, b & 7
    normal = jax.lax.bitcast_convert_type(((e + 120) << 23) | (m << 20), jnp.float32)
    mag = jnp.where(e == 0, m.astype(jnp.float32) * (2.0 ** -9), normal)
    return jnp.where((b >> 7) == 1, -mag, mag)


def decode_e2m1(c):
    """e2m1 codes (int32 0..15, bit 3 the sign) -> f32 values (exact)."""
    e, m = (c >> 1) & 3, c & 1
    normal = jax.lax.bitcast_convert_type(((e + 126) << 23) | (m << 22), jnp.float32)
    mag = jnp.where(e == 0, m.astype(jnp.float32) * 0.5, normal)
    return jnp.where((c >> 3) == 1, -mag, mag)


def _gather_packed(refs, fmt: str, idx, ok, A: int):
    """``[BLOCK, A]`` bf16 decoded rows of a packed pool (0 where not ``ok``): the codes and the
    scales are loaded as compact row tiles, nibbles interleaved and scales repeated in registers."""
    codes_ref, scales_ref = refs
    if fmt == "fp8":
        v = decode_e4m3(_gather_bytes(codes_ref, idx, ok, A))
        e = _gather_bytes(scales_ref, idx, ok, A // kv_codes.WINDOW_BLOCK)
        s = _expand(jax.lax.bitcast_convert_type(e << 23, jnp.float32), kv_codes.WINDOW_BLOCK)
    else:
        b = _gather_bytes(codes_ref, idx, ok, A // 2)  # even channel in the low nibble
        v = jnp.stack([decode_e2m1(b & 15), decode_e2m1(b >> 4)], axis=-1).reshape(b.shape[0], A)
        s = _expand(decode_e4m3(_gather_bytes(scales_ref, idx, ok, A // kv_codes.COMP_BLOCK)), kv_codes.COMP_BLOCK)
    return (v * s).astype(jnp.bfloat16)


def _block_scores(q, pool_refs, idx_ref, b, parts, scale: float, A: int):
    """Scores ``[Hb, BLOCK]`` (-inf where unused) and the gathered bf16 tile of block ``b``.

    A block straddling pools chains one masked gather per pool, each filling in the rows the
    previous ones left (``other=``): still one ``[BLOCK, A]`` tile and one pair of MMAs.
    ``pool_refs[i]`` is ``(fmt, refs)``: a bf16 pool's one ref or a packed pool's two."""
    idx = idx_ref[pl.ds(b * BLOCK, BLOCK)]
    valid = idx >= 0
    pos = jnp.arange(BLOCK, dtype=jnp.int32)
    kv = None
    for pool, lo, hi in parts:
        ok = valid if (lo, hi) == (0, BLOCK) else valid & (pos >= lo) & (pos < hi)
        fmt, refs = pool_refs[pool]
        if fmt == "bf16":
            other = 0.0 if kv is None else kv.astype(refs[0].dtype)
            kv = _gather(refs[0], idx, ok, A, other)
        else:
            tile = _gather_packed(refs, fmt, idx, ok, A)
            kv = tile if kv is None else jnp.where(ok[:, None], tile, kv.astype(jnp.bfloat16))
    kv = kv.astype(jnp.bfloat16)
    s = plgpu.dot(q, kv, trans_b=True) * scale  # [Hb, BLOCK] fp32
    s = jnp.where(valid[None, :], s, -jnp.inf)
    return s, kv


def _walk(plan, ends_ref, body, carry):
    """Run ``body`` over the blocks of ``plan`` in order, one loop per segment. The loop ends
    are read from ``ends_ref`` (the static ``seg.b1``, passed as data) so that Triton cannot
    fold a one-block loop into straight-line code: folded blocks kept their own shared-memory
    tiles alive next to the loops' pipeline buffers (> 227 KiB at A = 512) and spilled."""
    for k, seg in enumerate(plan):
        carry = lax.fori_loop(seg.b0, ends_ref[k], functools.partial(body, parts=seg.parts), carry)
    return carry


def _group_refs(refs, fmts: tuple[str, ...]):
    """The flat pool refs -> ``[(fmt, refs of that pool)]`` (a packed pool has two) and the rest."""
    out, i = [], 0
    for f in fmts:
        n = 1 if f == "bf16" else 2
        out.append((f, tuple(refs[i:i + n])))
        i += n
    return out, refs[i:]


def _attn_kernel(q_ref, idx_ref, ends_ref, sink_ref, *rest, fmts: tuple[str, ...], plan, scale: float,
                 has_m0: bool):
    if has_m0:
        m0_ref, *rest = rest
    pool_refs, (o_ref,) = _group_refs(rest, fmts)
    q = q_ref[...].astype(jnp.bfloat16)  # [Hb, A]
    Hb, A = q.shape

    def body(b, carry, *, parts):
        acc, m, l = carry
        s, kv = _block_scores(q, pool_refs, idx_ref, b, parts, scale, A)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        corr = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])  # fp32, relative to the running max
        l = l * corr + jnp.sum(p, axis=1)
        pv = plgpu.dot(p.astype(jnp.bfloat16), kv)  # [Hb, A] fp32
        acc = acc * corr[:, None] + pv
        return acc, m_new, l

    if has_m0:
        m = m0_ref[...]
    else:
        m = jnp.full((Hb,), _M_FLOOR, jnp.float32)
    carry = (jnp.zeros((Hb, A), jnp.float32), m, jnp.zeros((Hb,), jnp.float32))
    acc, m, l = _walk(plan, ends_ref, body, carry)
    l = l + jnp.exp(sink_ref[...] - m)
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)


def _max_kernel(q_ref, idx_ref, ends_ref, *rest, fmts: tuple[str, ...], plan, scale: float):
    """First pass of ``exact=False``: the final running max per head, floored at -1e30."""
    pool_refs, (m_ref,) = _group_refs(rest, fmts)
    q = q_ref[...].astype(jnp.bfloat16)
    Hb, A = q.shape

    def body(b, m, *, parts):
        s, _ = _block_scores(q, pool_refs, idx_ref, b, parts, scale, A)
        return jnp.maximum(m, jnp.max(s, axis=1))

    m_ref[...] = _walk(plan, ends_ref, body, jnp.full((Hb,), _M_FLOOR, jnp.float32))


# ----------------------------------------------------------------------------------------------
# Wrapper
# ----------------------------------------------------------------------------------------------
def supported(q_THA, pools, idxs) -> str | None:
    """``None`` when the kernel handles these shapes, else why not (the caller falls back)."""
    A = q_THA.shape[-1]
    if A < 16 or A & (A - 1):
        return f"head_dim {A} is not a power of two >= 16"
    if len(pools) != len(idxs) or not pools:
        return "pools and idxs must pair up"
    for p, i in zip(pools, idxs):
        fmt = kv_codes.pool_format(p)
        if fmt == "bf16" and p.ndim != 2:
            return f"pool {p.shape} is not [rows, head_dim]"
        rows, width = (p.shape[0], p.shape[1]) if fmt == "bf16" else (p.codes.shape[0], p.width)
        if width != A or i.ndim != 2 or i.shape[0] != q_THA.shape[0]:
            return f"pool of {rows} x {width} ({fmt}) / idx {i.shape} do not match q {q_THA.shape}"
        if fmt == "fp8" and A % kv_codes.WINDOW_BLOCK:
            return f"head_dim {A} is not a multiple of the fp8 pool's scale block {kv_codes.WINDOW_BLOCK}"
    return None


def _flat_pool_arrays(pool) -> tuple[jax.Array, ...]:
    """What the kernel reads of a pool: the bf16 array, or a packed pool's codes and scales as
    uint8 (e4m3 bytes bitcast: the kernel decodes the bits itself)."""
    if kv_codes.pool_format(pool) == "bf16":
        return (pool,)
    return tuple(a if a.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(a, jnp.uint8) for a in pool)


@functools.partial(jax.jit, static_argnames=("scale", "exact", "interpret", "block_h",
                                             "num_warps", "num_stages", "out_dtype"))
def sparse_attention(q_THA: jax.Array, pools: tuple[jax.Array, ...], idxs: tuple[jax.Array, ...],
                     sink_H: jax.Array, scale: float, exact: bool = True, *,
                     interpret: bool = False, block_h: int | None = None,
                     num_warps: int | None = None, num_stages: int | None = None,
                     out_dtype=jnp.bfloat16) -> jax.Array:
    """Kernel twin of ``sparse_attention_ref`` -> ``[T, H, A]`` (``out_dtype``, bf16 as the
    reference; fp32 only for tests). ``block_h``/``num_warps``/``num_stages`` override the
    tiling heuristics (benchmarks)."""
    pools, idxs = tuple(pools), tuple(idxs)
    why = supported(q_THA, pools, idxs)
    if why is not None:
        raise ValueError(f"sparse_attention kernel: {why}")
    T, H, A = q_THA.shape
    widths = tuple(int(i.shape[1]) for i in idxs)
    if T == 0 or sum(widths) == 0:  # no entries: the sink takes all the mass, as the reference
        return jnp.zeros((T, H, A), out_dtype)

    gen = _gen_tuning()
    bh = block_h or pick_block_h(H, T, gen)
    if bh < 16 or bh & (bh - 1):
        raise ValueError(f"block_h={bh}: must be a power of two >= 16")
    plan = block_plan(widths)
    nw, ns = pick_launch(bh, A, gen, straddling=any(len(seg.parts) > 1 for seg in plan))
    nw, ns = num_warps or nw, num_stages or ns

    Hp = -(-H // bh) * bh
    n_hb = Hp // bh
    Mp = plan[-1].b1 * BLOCK
    q = q_THA.astype(jnp.bfloat16)
    sink = sink_H.astype(jnp.float32)
    if Hp != H:
        q = jnp.pad(q, ((0, 0), (0, Hp - H), (0, 0)))
        sink = jnp.pad(sink, (0, Hp - H))
    idx = jnp.concatenate([i.astype(jnp.int32) for i in idxs], axis=1)
    idx = jnp.pad(idx, ((0, 0), (0, Mp - idx.shape[1])), constant_values=-1)

    ends = jnp.asarray([seg.b1 for seg in plan], jnp.int32)
    ends_spec = pl.BlockSpec((len(plan),), lambda i: (0,))

    grid = (T * n_hb,)  # head blocks of one token are neighbours: their gathers share L2
    q_spec = pl.BlockSpec((None, bh, A), lambda i: (i // n_hb, i % n_hb, 0))
    idx_spec = pl.BlockSpec((None, Mp), lambda i: (i // n_hb, 0))
    th_spec = pl.BlockSpec((None, bh), lambda i: (i // n_hb, i % n_hb))
    fmts = tuple(kv_codes.pool_format(p) for p in pools)
    flat = tuple(a for p in pools for a in _flat_pool_arrays(p))
    pool_specs = [pl.BlockSpec(a.shape, lambda i: (0, 0)) for a in flat]
    params = plgpu.CompilerParams(num_warps=nw, num_stages=ns)

    m0 = ()
    if not exact:
        m_final = pl.pallas_call(
            functools.partial(_max_kernel, fmts=fmts, plan=plan, scale=float(scale)),
            grid=grid,
            in_specs=[q_spec, idx_spec, ends_spec, *pool_specs],
            out_specs=th_spec,
            out_shape=jax.ShapeDtypeStruct((T, Hp), jnp.float32),
            compiler_params=params,
            interpret=interpret,
            name="sparse_attn_max",
        )(q, idx, ends, *flat)
        m0 = (m_final,)

    out = pl.pallas_call(
        functools.partial(_attn_kernel, fmts=fmts, plan=plan, scale=float(scale),
                          has_m0=not exact),
        grid=grid,
        in_specs=[q_spec, idx_spec, ends_spec, pl.BlockSpec((bh,), lambda i: (i % n_hb,)),
                  *([th_spec] if not exact else []), *pool_specs],
        out_specs=pl.BlockSpec((None, bh, A), lambda i: (i // n_hb, i % n_hb, 0)),
        out_shape=jax.ShapeDtypeStruct((T, Hp, A), out_dtype),
        compiler_params=params,
        interpret=interpret,
        name="sparse_attn",
    )(q, idx, ends, sink, *m0, *flat)
    return out[:, :H] if Hp != H else out


def sparse_attention_op(q_THA, pools, idxs, sink_H, scale: float, exact: bool = True):
    """What ``ops.sparse_attention`` runs on GPU: the kernel, or the reference for what the
    kernel does not take (a head_dim that is not a power of two, a traced ``scale``). On a
    multi-device mesh it is a custom call on replicated operands (the caches are replicated
    today); slot-sharded caches will need a shard_map wrapper like ``moe_ep.py``."""
    pools, idxs = tuple(pools), tuple(idxs)
    try:
        scale_f = float(scale)
    except (TypeError, jax.errors.ConcretizationTypeError):
        scale_f = None
    why = "a traced softmax scale" if scale_f is None else supported(q_THA, pools, idxs)
    if why is not None:
        from deepinfer_jax.kernels_pallas import ops
        from deepinfer_jax.kernels_pallas.sparse_attention_ref import sparse_attention_ref

        ops.note_fallback("sparse_attention", why)
        return sparse_attention_ref(q_THA, pools, idxs, sink_H, scale, exact)
    return sparse_attention(q_THA, pools, idxs, sink_H, scale_f, exact)


def _register() -> None:
    from deepinfer_jax.kernels_pallas import ops

    ops.register_kernel("sparse_attention", "gpu", sparse_attention_op)


_register()
