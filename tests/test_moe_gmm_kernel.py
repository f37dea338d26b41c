"""Grouped-matmul MoE kernel (``kernels_pallas/moe_gmm.py``) against the jnp reference.

Every kernel test runs twice: ``interpret`` (default selection, CPU: Pallas' GPU interpret mode
simulates shared memory, TMA, barriers and wgmma) and ``compiled`` (marked ``device``: Mosaic
GPU on a Hopper GPU, ``pytest -m device``). Inputs are fresh random draws (never zeros); ragged
edges: empty groups, a group longer than a row tile, groups and M that are not tile multiples,
rows past ``sum(group_sizes)``, routing ids ``-1`` and ``>= n_experts``.

Tolerances. Kernel and reference both take bf16 operands, accumulate in fp32 and round the
output to bf16; they differ only in the fp32 summation order, i.e. by about one bf16 rounding
of the output (relative 2^-8 = 0.4%). In ``moe_experts`` that difference can also flip the bf16
rounding of gate/up and, for fp8/fp4 experts, the e4m3 rounding of one ``h`` element (one e4m3
step = 2^-3 relative on that element, which enters one of F terms of a down-projection
output). Hence: ``|out - ref| <= 2e-2 |ref| + 2e-2 max|ref|`` elementwise and a relative
Frobenius error <= 1e-2. Against a float32 ground truth (same quantized weights and QDQ
points, all products and intermediates in fp32) the kernel's error must be no larger than the
reference's (x1.25 + 1e-3): the kernel is as close to the exact function as the reference is.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.kernels_pallas import moe_gmm, moe_gmm_ref, ops, tiling
from deepinfer_jax.base import quant
from deepinfer_jax.checkpoint import quant_formats as qf

MODES = [
    pytest.param(True, id="interpret"),
    pytest.param(False, id="compiled", marks=pytest.mark.device),
]


@pytest.fixture(params=MODES)
def interpret(request):
    if not request.param and jax.default_backend() != "gpu":
        pytest.skip("compiled Mosaic GPU kernels need a GPU")
    return request.param


# ----------------------------------------------------------------------------- inputs
def _weights(rng, fmt: str, E: int, O: int, K: int):
    """Random stacked expert weights in storage format, built with the checkpoint quantizers."""
    w = rng.standard_normal((E * O, K), dtype=np.float32) / np.float32(np.sqrt(K))
    if fmt == "bf16":
        return jnp.asarray(w.reshape(E, O, K), jnp.bfloat16), None
    if fmt == "fp8":  # 32x32 blocks never straddle experts (O % 32 == 0)
        q, s = qf.quantize_fp8_block(w)
        return jnp.asarray(q.reshape(E, O, K)), jnp.asarray(s.reshape(E, O // 32, K // 32))
    q, s = qf.quantize_fp4(w)
    return jnp.asarray(q.view(np.uint8).reshape(E, O, K // 2)), jnp.asarray(s.reshape(E, O, K // 32))


def _close(out, ref, name=""):
    out = np.asarray(out, np.float32)
    ref = np.asarray(ref, np.float32)
    assert out.shape == ref.shape
    assert np.isfinite(out).all(), f"{name}: non-finite output"
    scale = float(np.abs(ref).max())
    assert scale > 0, "reference is all zeros: the test would prove nothing"
    rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert rel <= 1e-2, f"{name}: relative error {rel:.3e}"
    np.testing.assert_allclose(out, ref, rtol=2e-2, atol=2e-2 * scale, err_msg=name)
    return rel


def _rel(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# ----------------------------------------------------------------------------- float32 truth
def _moe_truth(x_TD, idx_TX, weight_TX, w1, w2, w3, fmt, limit, n_experts):
    """The op in fp32 everywhere (same QDQ points as the reference, no bf16 intermediates)."""
    T, X = idx_TX.shape
    quantized = fmt in ("fp8", "fp4")
    a = quant.act_quant_fp8(x_TD.astype(jnp.float32)) if quantized else x_TD.astype(jnp.float32)
    flat_e = idx_TX.reshape(-1)
    ok = (flat_e >= 0) & (flat_e < n_experts)
    key = jnp.where(ok, flat_e, n_experts)
    order = jnp.argsort(key, stable=True)
    sizes = jnp.bincount(key, length=n_experts + 1)[:n_experts].astype(jnp.int32)
    deq = lambda w: moe_gmm_ref.dequant_experts(*w, fmt).astype(jnp.float32)
    mm = lambda h, W: jax.lax.ragged_dot(h, jnp.swapaxes(W, 1, 2), sizes, precision=jax.lax.Precision.HIGHEST,
                                         preferred_element_type=jnp.float32)
    xs = a[order // X]
    gate, up = mm(xs, deq(w1)), mm(xs, deq(w3))
    if limit > 0:
        up = jnp.clip(up, -limit, limit)
        gate = jnp.minimum(gate, limit)
    h = jax.nn.silu(gate) * up * weight_TX.reshape(-1)[order][:, None].astype(jnp.float32)
    if quantized:
        h = quant.act_quant_fp8(h)
    y = jnp.where(ok[order][:, None], mm(h, deq(w2)), 0)
    return jnp.zeros_like(y).at[order].set(y).reshape(T, X, -1)


# ----------------------------------------------------------------------------- pure helpers (fast)
def test_fp4_decode_matches_table():
    codes = jnp.arange(16, dtype=jnp.int32)
    got = np.asarray(moe_gmm._fp4_codes_to_f32(codes))
    np.testing.assert_array_equal(got, quant.FP4_TABLE)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(quant.FP4_TABLE))


def test_e8m0_to_f32():
    e = jnp.arange(1, 255, dtype=jnp.uint8)
    np.testing.assert_array_equal(np.asarray(moe_gmm._e8m0_to_f32(e)), qf.e8m0_to_float(np.asarray(e)))


@pytest.mark.parametrize("sizes,m_rows,bm", [([0, 75, 3, 40], 136, 64), ([130, 0, 60], 200, 128),
                                              ([0, 0, 0], 10, 64), ([64, 64], 128, 64)])
def test_aligned_layout(sizes, m_rows, bm):
    gs = jnp.asarray(sizes, jnp.int32)
    lay = tiling.aligned_layout(gs, m_rows, bm)
    tg = np.asarray(lay.tile_group)
    want = np.concatenate([np.full(-(-g // bm), e) for e, g in enumerate(sizes)] + [np.zeros(0)]).astype(int)
    assert lay.n_tiles >= len(want)
    np.testing.assert_array_equal(tg[:len(want)], want)
    assert (tg[len(want):] == -1).all()
    src, valid = (np.asarray(v) for v in lay.padded_row_source())
    assert valid.sum() == sum(sizes)
    np.testing.assert_array_equal(np.sort(src[valid]), np.arange(sum(sizes)))
    # round trip: padded position of every real row points back at it
    grp = tiling.group_of_row(gs, m_rows)
    pos = np.asarray(lay.padded_position(jnp.arange(m_rows, dtype=jnp.int32), grp))
    real = np.asarray(grp) >= 0
    np.testing.assert_array_equal(src[pos[real]], np.arange(m_rows)[real])
    assert valid[pos[real]].all()


def test_count_at_most_is_searchsorted_without_a_loop():
    """The layout's group lookups equal ``searchsorted(side="right")`` (ties, empty groups,
    values outside the range) and leave no XLA while loop in the MoE step."""
    rng = np.random.default_rng(3)
    for _ in range(50):
        a = np.sort(rng.integers(0, 40, rng.integers(1, 12))).astype(np.int32)
        v = rng.integers(-3, 45, (rng.integers(1, 5), rng.integers(1, 30))).astype(np.int32)
        np.testing.assert_array_equal(np.asarray(tiling.count_at_most(jnp.asarray(a), jnp.asarray(v))),
                                      np.searchsorted(a, v, side="right"))
    text = jax.jit(lambda g: (tiling.aligned_layout(g, 512, 64).tile_group, tiling.group_of_row(g, 512))).lower(
        jnp.zeros((8,), jnp.int32)).as_text()
    assert "while" not in text


@pytest.mark.parametrize("m_rows,n_groups,bm", [(512, 8, 64), (128, 8, 64), (2048, 8, 128), (300, 6, 64)])
def test_expected_active_tiles_matches_uniform_routing(m_rows, n_groups, bm):
    """The tile-count estimate the decode tiling relies on equals the mean number of row tiles
    of uniformly routed rows (simulated), within 10%: e.g. 512 rows over 8 experts need ~12
    tiles of 64, not 8."""
    rng = np.random.default_rng(m_rows)
    sizes = rng.multinomial(m_rows, [1 / n_groups] * n_groups, size=2000)
    simulated = (-(-sizes // bm)).sum(1).mean()
    assert abs(tiling.expected_active_tiles(m_rows, n_groups, bm) - simulated) <= 0.1 * simulated


def test_hopper_tiling_regimes():
    dec = moe_gmm.hopper_tiling(128, 8, 2304, 5120, "fp8", fused=True)
    pre = moe_gmm.hopper_tiling(32768, 8, 2304, 5120, "fp8", fused=True)
    assert dec.block_m == 64 and pre.block_m == 128
    for fmt in moe_gmm.FORMATS:
        for m in (128, 512, 2048, 12288, 32768):
            for fused, (n, k) in ((True, (2304, 5120)), (False, (5120, 2304))):
                c = moe_gmm.hopper_tiling(m, 8, n, k, fmt, fused)
                assert n % c.block_n == 0 and k % c.block_k == 0 and c.block_k % 32 == 0
                assert c.block_m * c.block_n * (2 if fused else 1) <= 128 * 128  # accumulator registers
                assert 2 <= c.stages <= 6
                assert (k // c.block_k) % c.k_splits == 0
                assert c.k_splits == 1 or c.block_m == 64  # splitting is a decode tiling
                assert not c.fp8_mma  # the native fp8 kernel is an explicit choice only
                # CTAs sharing an SM share its shared memory: the depth is the one for that share
                assert c.stages == moe_gmm._hopper_stages(c.block_m, c.block_n, c.block_k, fmt, 2 if fused else 1,
                                                          fused, ctas_per_sm=c.ctas_per_sm)
    # decode: the dequantizing formats run two CTAs per SM where a tiling fits the half (fp8
    # both projections; fp4 the down projection), bf16 (streaming) one
    assert [moe_gmm.hopper_tiling(512, 8, 2304, 5120, f, True).ctas_per_sm for f in ("bf16", "fp8")] == [1, 2]
    assert [moe_gmm.hopper_tiling(512, 8, 5120, 2304, f, False).ctas_per_sm for f in ("bf16", "fp8", "fp4")] == [1, 2, 2]
    assert moe_gmm.hopper_tiling(32768, 8, 2304, 5120, "fp8", True).ctas_per_sm == 1  # prefill


def test_fp8_mma_tiling_fits_registers_and_shared_memory():
    from deepinfer_jax.kernels_pallas import moe_gmm_fp8mma

    for m in (128, 512):
        for fused, (n, k) in ((True, (2304, 5120)), (False, (5120, 2304))):
            c = moe_gmm.fp8_mma_tiling(m, 8, n, k, fused)
            n_w = 2 if fused else 1
            assert c.fp8_mma and c.block_m == 64 and n % c.block_n == 0 and k % c.block_k == 0
            assert moe_gmm_fp8mma.acc_registers(c.block_m, c.block_n, n_w) <= moe_gmm.FP8_MMA_ACC_REGS
            smem = c.stages * moe_gmm_fp8mma.stage_bytes(c.block_m, c.block_n, c.block_k, n_w) + c.block_m * c.block_n * 2
            assert smem <= moe_gmm.HOPPER_SM_SMEM_BYTES // c.ctas_per_sm - 1024
    assert moe_gmm.fp8_mma_tiling(512, 8, 2304, 5000, True) is None  # K not a multiple of 128


def test_ops_hook_keeps_reference_on_cpu():
    assert ops._KERNELS.get(("moe_experts", "gpu")) is moe_gmm.moe_experts_op
    if jax.default_backend() == "cpu":
        assert ops._pick("moe_experts", moe_gmm_ref.moe_experts_ref) is moe_gmm_ref.moe_experts_ref


# ----------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp4"])
def test_grouped_matmul_ragged(fmt, interpret):
    """Empty group, a group longer than a 64-row tile, a 3-row group, M=136 not a tile
    multiple and 18 trailing rows outside every group (must come back as zeros)."""
    rng = np.random.default_rng(moe_gmm.FORMATS.index(fmt))
    M, K, O, E = 136, 128, 128, 4
    sizes = jnp.asarray([0, 75, 3, 40], jnp.int32)
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
    w, s = _weights(rng, fmt, E, O, K)
    out = moe_gmm.grouped_matmul(x, w, s, sizes, fmt, interpret=interpret)
    ref = moe_gmm_ref._grouped(x, moe_gmm_ref.dequant_experts(w, s, fmt), sizes)
    n = int(sizes.sum())
    _close(out[:n], ref[:n], f"grouped {fmt}")
    assert (np.asarray(out[n:], np.float32) == 0).all()


def test_grouped_matmul_prefill_tile(interpret):
    """block_m=128 (the prefill tile): a 130-row group spans two tiles."""
    rng = np.random.default_rng(7)
    M, K, O, E = 200, 128, 128, 3
    sizes = jnp.asarray([130, 0, 60], jnp.int32)
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
    w, s = _weights(rng, "fp8", E, O, K)
    out = moe_gmm.grouped_matmul(x, w, s, sizes, "fp8", interpret=interpret, block_m=128)
    ref = moe_gmm_ref._grouped(x, moe_gmm_ref.dequant_experts(w, s, "fp8"), sizes)
    _close(out[:190], ref[:190], "grouped fp8 bm=128")
    assert (np.asarray(out[190:], np.float32) == 0).all()


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp4"])
def test_grouped_matmul_k_splits(fmt, interpret):
    """The contraction cut into slices (decode tiling: fp32 partial sums added after the
    kernel) gives the reference's result, ragged groups and trailing rows included."""
    rng = np.random.default_rng(20 + moe_gmm.FORMATS.index(fmt))
    M, K, O, E = 136, 512, 128, 4
    sizes = jnp.asarray([70, 0, 3, 45], jnp.int32)
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
    w, s = _weights(rng, fmt, E, O, K)
    splits = 2 if fmt == "fp4" else 4  # fp4 steps are 128 wide: 4 K steps here
    out = moe_gmm.grouped_matmul(x, w, s, sizes, fmt, interpret=interpret, k_splits=splits)
    ref = moe_gmm_ref._grouped(x, moe_gmm_ref.dequant_experts(w, s, fmt), sizes)
    n = int(sizes.sum())
    _close(out[:n], ref[:n], f"grouped {fmt} k_splits={splits}")
    assert (np.asarray(out[n:], np.float32) == 0).all()


def test_k_splits_must_divide_the_k_steps():
    x = jnp.ones((8, 128), jnp.bfloat16)
    w = jnp.ones((2, 64, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="k_splits=3"):
        moe_gmm.grouped_matmul(x, w, None, jnp.asarray([4, 4], jnp.int32), "bf16", interpret=True, k_splits=3)


def _moe_case(rng, fmt, T, X, D, F, E):
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.bfloat16)
    # ids in [-1, E]: -1 and E are out of range and must give zeros
    idx = jnp.asarray(rng.integers(-1, E + 1, (T, X)), jnp.int32)
    wt = jnp.asarray(rng.uniform(0.1, 1.0, (T, X)), jnp.float32)
    w1, w2, w3 = _weights(rng, fmt, E, F, D), _weights(rng, fmt, E, D, F), _weights(rng, fmt, E, F, D)
    return x, idx, wt, w1, w2, w3


@pytest.mark.parametrize("fmt,limit,E", [("bf16", 0.0, 4), ("fp8", 0.75, 6), ("fp4", 0.75, 4)])
def test_moe_experts(fmt, limit, E, interpret):
    rng = np.random.default_rng(11 + E)
    T, X, D, F = 12, 4, 256, 128
    args = _moe_case(rng, fmt, T, X, D, F, E)
    out = moe_gmm.moe_experts(*args, fmt, limit, E, interpret=interpret)
    ref = moe_gmm_ref.moe_experts_ref(*args, fmt, limit, E)
    _close(out, ref, f"moe {fmt}")
    bad = ~((args[1] >= 0) & (args[1] < E))
    assert bool(bad.any()) and (np.asarray(out, np.float32)[np.asarray(bad)] == 0).all()
    truth = _moe_truth(*args, fmt, limit, E)
    assert _rel(out, truth) <= 1.25 * _rel(ref, truth) + 1e-3


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_moe_experts_k_splits(fmt, interpret):
    """Both kernels with the contraction split (the fused gate+up then finishes SwiGLU and the
    routing weight after the partial sums are added) against the reference."""
    rng = np.random.default_rng(31)
    T, X, D, F, E = 10, 3, 256, 128, 4
    args = _moe_case(rng, fmt, T, X, D, F, E)
    up = tiling.GmmTiling(block_m=64, block_n=64, block_k=64, stages=2, grid_tile_width=F // 64, k_splits=2)
    dn = tiling.GmmTiling(block_m=64, block_n=128, block_k=64, stages=2, grid_tile_width=D // 128, k_splits=2)
    out = moe_gmm.moe_experts(*args, fmt, 0.75, E, interpret=interpret, tiles_up=up, tiles_down=dn)
    ref = moe_gmm_ref.moe_experts_ref(*args, fmt, 0.75, E)
    _close(out, ref, f"moe {fmt} k_splits")
    truth = _moe_truth(*args, fmt, 0.75, E)
    assert _rel(out, truth) <= 1.25 * _rel(ref, truth) + 1e-3


@pytest.mark.parametrize("T,X,E,ctas", [(12, 4, 6, 2), (40, 3, 4, 1)])
def test_moe_experts_native_fp8_mma(T, X, E, ctas, interpret):
    """fp8 experts on the native fp8 ``wgmma`` kernel (e4m3 activations x e4m3 weights, per-32
    scale promotion; ``moe_gmm_fp8mma.py``), both launches, against the reference: ragged
    experts, out-of-range ids, 1 or 2 CTAs per SM."""
    rng = np.random.default_rng(41 + T)
    D, F = 256, 128
    args = _moe_case(rng, "fp8", T, X, D, F, E)
    up = dataclasses.replace(moe_gmm.fp8_mma_tiling(T * X, E, F, D, True), ctas_per_sm=ctas)
    dn = dataclasses.replace(moe_gmm.fp8_mma_tiling(T * X, E, D, F, False), ctas_per_sm=ctas)
    out = moe_gmm.moe_experts(*args, "fp8", 0.75, E, interpret=interpret, tiles_up=up, tiles_down=dn)
    ref = moe_gmm_ref.moe_experts_ref(*args, "fp8", 0.75, E)
    _close(out, ref, "moe fp8 native mma")
    bad = ~((args[1] >= 0) & (args[1] < E))
    assert (np.asarray(out, np.float32)[np.asarray(bad)] == 0).all()
    truth = _moe_truth(*args, "fp8", 0.75, E)
    assert _rel(out, truth) <= 1.25 * _rel(ref, truth) + 1e-3


@pytest.mark.parametrize("field,value", [("ctas_per_sm", 0), ("stages", -1), ("block_n", 64.0)])
def test_tiling_rejects_non_positive_fields(field, value):
    kw = dict(block_m=64, block_n=64, block_k=64, stages=2)
    kw[field] = value
    with pytest.raises(ValueError, match=f"GmmTiling.{field}={value!r}"):
        tiling.GmmTiling(**kw)


def test_fp8_mma_tiling_needs_fp8_experts():
    rng = np.random.default_rng(5)
    args = _moe_case(rng, "bf16", 4, 2, 256, 128, 4)
    up = moe_gmm.fp8_mma_tiling(8, 4, 128, 256, True)
    with pytest.raises(ValueError, match="fp8_mma"):
        moe_gmm.moe_experts(*args, "bf16", 0.0, 4, interpret=True, tiles_up=up)


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def _weight_sds(fmt, E, O, K):
    if fmt == "bf16":
        return _sds((E, O, K), jnp.bfloat16), None
    if fmt == "fp8":
        return _sds((E, O, K), jnp.float8_e4m3fn), _sds((E, O // 32, K // 32), jnp.uint8)
    return _sds((E, O, K // 2), jnp.uint8), _sds((E, O, K // 32), jnp.uint8)


@pytest.mark.parametrize("fmt,T", [("bf16", 96), ("fp8", 16), ("fp4", 16)])
def test_lowers_for_hopper(fmt, T):
    """Ahead-of-time lowering for an SM90 target on this (CPU) machine: runs Pallas' Mosaic GPU
    lowering, layout inference, the dialect lowering to NVVM/LLVM and the 227 KB shared-memory
    check (not ptxas nor the kernel itself). T=16 takes the decode tiles, T=96 the prefill ones."""
    E, X, D, F = 8, 6, 256, 128
    f = jax.jit(lambda *a: moe_gmm.moe_experts(*a, fmt, 10.0, E))
    try:
        exp = jax.export.export(f, platforms=["cuda"])(
            _sds((T, D), jnp.bfloat16), _sds((T, X), jnp.int32), _sds((T, X), jnp.float32),
            _weight_sds(fmt, E, F, D), _weight_sds(fmt, E, D, F), _weight_sds(fmt, E, F, D))
    except ImportError as e:  # pragma: no cover - jaxlib without the Mosaic GPU dialect
        pytest.skip(f"no Mosaic GPU lowering here: {e}")
    assert exp.mlir_module().count("mosaic_gpu") >= 2  # the two kernels (gate+up, down)


@pytest.mark.parametrize("fmt,block_n,splits", [("bf16", 192, 4), ("bf16", 256, 2), ("fp8", 128, 2)])
def test_decode_tilings_lower_for_hopper(fmt, block_n, splits):
    """The decode tilings the cost model can pick (wide column tiles, split contraction with
    fp32 partial tiles) pass Mosaic GPU's lowering and shared-memory check for SM90, for the
    plain and the fused gate+up kernel."""
    E, M, K = 4, 64, 512
    O = 2 * block_n
    cfg = tiling.GmmTiling(block_m=64, block_n=block_n, block_k=64, stages=3, grid_tile_width=2, k_splits=splits)
    fused_cfg = dataclasses.replace(cfg, block_n=min(block_n, 128), grid_tile_width=O // min(block_n, 128))
    lay_sds = _sds((tiling.num_tiles_bound(M, E, 64),), jnp.int32)
    n_tiles = lay_sds.shape[0]
    x_sds = _sds((n_tiles * 64, K), jnp.bfloat16)
    w_sds = _weight_sds(fmt, E, O, K)
    w_op = lambda w, s: moe_gmm._weight_operand(w, s, fmt, O)

    def plain(tg, x, w, s):
        return moe_gmm._hopper_gmm(tg, x, [w_op(w, s)], None, fmt=fmt, n_out=O, k_in=K, cfg=cfg,
                                   swiglu_limit=0.0, interpret=False)

    def fused(tg, x, w, s, rw):
        return moe_gmm._hopper_gmm(tg, x, [w_op(w, s), w_op(w, s)], rw, fmt=fmt, n_out=O, k_in=K,
                                   cfg=fused_cfg, swiglu_limit=0.75, interpret=False)

    try:
        e1 = jax.export.export(jax.jit(plain), platforms=["cuda"])(lay_sds, x_sds, *w_sds)
        e2 = jax.export.export(jax.jit(fused), platforms=["cuda"])(lay_sds, x_sds, *w_sds,
                                                                   _sds((n_tiles * 64,), jnp.float32))
    except ImportError as e:  # pragma: no cover - jaxlib without the Mosaic GPU dialect
        pytest.skip(f"no Mosaic GPU lowering here: {e}")
    assert "mosaic_gpu" in e1.mlir_module() and "mosaic_gpu" in e2.mlir_module()


@pytest.mark.parametrize("native", [False, True])
def test_fp8_decode_tilings_lower_for_hopper(native):
    """fp8 experts at a decode size with the default tiling (dequantizing kernel, two CTAs per
    SM) and with the native fp8 ``wgmma`` tiling pass Mosaic GPU's lowering for SM90."""
    E, X, D, F, T = 8, 6, 512, 256, 16
    up = moe_gmm.fp8_mma_tiling(T * X, E, F, D, True) if native else None
    dn = moe_gmm.fp8_mma_tiling(T * X, E, D, F, False) if native else None
    f = jax.jit(lambda *a: moe_gmm.moe_experts(*a, "fp8", 10.0, E, tiles_up=up, tiles_down=dn))
    try:
        exp = jax.export.export(f, platforms=["cuda"])(
            _sds((T, D), jnp.bfloat16), _sds((T, X), jnp.int32), _sds((T, X), jnp.float32),
            _weight_sds("fp8", E, F, D), _weight_sds("fp8", E, D, F), _weight_sds("fp8", E, F, D))
    except ImportError as e:  # pragma: no cover - jaxlib without the Mosaic GPU dialect
        pytest.skip(f"no Mosaic GPU lowering here: {e}")
    assert exp.mlir_module().count("mosaic_gpu") >= 2


# ----------------------------------------------------------------------------- device only
_V41_WEIGHTS: dict = {}


_V41_CASES = [(f, T) for f in ("bf16", "fp8", "fp4") for T in (32, 512)] + [("fp8-mma", 32), ("fp8-mma", 80)]


@pytest.mark.device
@pytest.mark.parametrize("fmt,T", _V41_CASES)  # T=32, 80: decode tiles (block_m 64); 512: prefill (128)
def test_moe_experts_v41_shapes(fmt, T):
    """V4.1 expert shapes (D=5120, F=2304, 8 local experts, top-6 with some ids off this
    shard), compiled, against the reference on the same GPU. ``fp8-mma``: fp8 experts on the
    native fp8 ``wgmma`` kernel (explicit tilings; the real fp8 adder of the tensor core)."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    E, X, D, F = 8, 6, 5120, 2304
    tiles = {}
    if fmt == "fp8-mma":
        fmt = "fp8"
        tiles = dict(tiles_up=moe_gmm.fp8_mma_tiling(T * X, E, F, D, True),
                     tiles_down=moe_gmm.fp8_mma_tiling(T * X, E, D, F, False))
        assert tiles["tiles_up"] is not None and tiles["tiles_down"] is not None
    if fmt not in _V41_WEIGHTS:  # quantizing 3 x 94M weights on the host: once per format
        wr = np.random.default_rng(100 + moe_gmm.FORMATS.index(fmt))
        _V41_WEIGHTS[fmt] = (_weights(wr, fmt, E, F, D), _weights(wr, fmt, E, D, F), _weights(wr, fmt, E, F, D))
    rng = np.random.default_rng(T)
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.bfloat16)
    idx = jnp.asarray(rng.integers(-1, E + 1, (T, X)), jnp.int32)
    wt = jnp.asarray(rng.uniform(0.1, 1.0, (T, X)), jnp.float32)
    args = (x, idx, wt, *_V41_WEIGHTS[fmt])
    out = jax.jit(lambda *a: moe_gmm.moe_experts(*a, fmt, 10.0, E, **tiles))(*args)
    ref = jax.jit(lambda *a: moe_gmm_ref.moe_experts_ref(*a, fmt, 10.0, E))(*args)
    _close(out, ref, f"moe {fmt} T={T}{' native fp8 mma' if tiles else ''}")
    truth = _moe_truth(*args, fmt, 10.0, E)
    assert _rel(out, truth) <= 1.25 * _rel(ref, truth) + 1e-3


def test_unsupported_widths_fall_back_to_the_reference():
    """Widths the kernels cannot tile (the tiny model's fp4 experts: the down projection's K=F=64
    is below the 128-wide fp4 K block) are reported so that ``moe_experts_op`` runs the
    reference instead of failing at trace time (as it did on the GPU before this check)."""
    import jax.numpy as jnp

    from deepinfer_jax.kernels_pallas.moe_gmm import shapes_supported

    x = jnp.ones((4, 128), jnp.bfloat16)
    idx = jnp.zeros((4, 2), jnp.int32)
    tiny_w1 = (jnp.zeros((8, 64, 64), jnp.uint8), jnp.zeros((8, 64, 4), jnp.uint8))
    assert not shapes_supported(x, idx, tiny_w1, "fp4", 8)
    x = jnp.ones((4, 5120), jnp.bfloat16)
    flash_w1 = (jnp.zeros((8, 2304, 2560), jnp.uint8), jnp.zeros((8, 2304, 160), jnp.uint8))
    assert shapes_supported(x, idx, flash_w1, "fp4", 8)


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_moe_kernels_lowered_once_per_program(fmt):
    """A step calls the MoE op once per layer with the same shapes; its two Mosaic GPU kernels
    must be lowered once per program, not once per layer (the Mosaic lowering costs seconds per
    launch site, so a per-layer lowering made a step's compile grow with its depth). Lowered
    for CUDA on any host: three chained layers give one gate+up and one down launch site."""
    rng = np.random.default_rng(5)
    E = 4
    x, idx, wt, w1, w2, w3 = _moe_case(rng, fmt, 12, 4, 256, 128, E)

    def three_layers(x, *rest):
        for _ in range(3):
            x = moe_gmm.moe_experts(x, *rest, fmt, 0.75, E).sum(1)
        return x

    hlo = jax.jit(three_layers).trace(x, idx, wt, w1, w2, w3).lower(lowering_platforms=("cuda",)).as_text()
    assert len(re.findall(r"custom_call @mosaic_gpu", hlo)) == 2
