"""Pallas (Triton lowering, NVIDIA GPU) kernels for the CSA2 indexer: scoring and top-k selection.

Semantics are those of ``indexer_topk_ref`` (the oracle): bf16 scores
``score[t, j] = bf16(sum_h bf16(relu(bf16(q[t,h] . k[j])) * w[t,h]))`` for ``j < n_visible[t]``
(else -inf), and top-k positions sorted ascending, ``-1`` for unused slots, ties at the k-th
score going to the lowest positions.

Kernels (all ``pl.pallas_call`` with the Triton lowering; every one also runs in interpret mode):

``_score_kernel``  keys gathered per token ``[T, N, J]`` (the model's current call); grid
    ``(T, position blocks)``, per program a loop over ``BN``-position tiles: ``keys[BN, J] @
    q[t].T -> [BN, I]`` (tensor cores, f32 acc), then the reference's bf16 epilogue (relu, bf16
    round, * w rounded to bf16, f32 sum over heads, bf16 round), -inf past ``n_visible``. Tiles
    wholly past ``n_visible`` skip the key loads (causal prefill: about half). Memory-bound on the
    key reads (H200: ~4.1 TB/s at T=256, N=128k).
``_score_pool_kernel``  keys read in place from the cache pool ``[P, J]`` through the per-row
    entry index ``[R, N]`` and ``token_row [T]`` (no ``[T, N, J]`` gather copy). A program takes
    TB tokens: their queries form one MMA operand, the per-token head sums are a second MMA with a
    block-diagonal ones matrix, and tokens of one request row (prefill) share each key tile.
    The pool may hold the model's index-key cache format instead of bf16: e5m2 codes plus a
    power-of-two scale per entry (``quant.pack_index_keys``), converted in registers; the scale
    multiplies the f32 head sum. Bit-identical to scoring the decoded bf16 keys, 52% of the bytes.

Selection (exact radix select on the bf16 bit pattern, 5 kernels; no jnp glue):
    a bf16 score maps to a monotone 16-bit key (total order: -0 < +0 like ``lax.top_k``); -inf
    (not visible / masked out) maps to key 0 = "invalid".
    A ``_chunkmax_kernel`` grid ``(T, blocks)``: max key of every chunk of ``C`` positions
      (``N/C`` ~ 2k chunks).
    B ``_bound_kernel`` grid ``(T,)``: ``low`` = the exact k-th largest chunk max (two 8-bit
      histogram passes over the ``N/C`` maxima). At least k positions have key >= low, so every
      top-k position does.
    C ``_candidates_kernel`` grid ``(T, N/SEG)``: each segment compacts its positions with key >=
      low (ascending) into its own slot of a scratch list and counts them (typically ~k..1.4k per
      row in all; a segment's slot holds its whole segment, so nothing overflows: heavy ties only
      make the list longer).
    D ``_select_kernel`` grid ``(T,)``: over the candidates (segments' lists in order), two 8-bit
      histogram passes give the exact k-th key ``tau`` and how many ties at ``tau`` to take
      (``need``); then an order-preserving compaction writes the positions with key > tau plus
      the first ``need`` positions with key == tau: exactly the ascending, lowest-position-tie-
      broken answer, no sort needed. Remaining slots get -1.
    Histograms: 256 bins as a 16x16 matrix, ``onehot(hi nibble).T @ onehot(lo nibble)`` on the
    tensor cores (exact integer counts in f32), since Triton has no shared-memory atomics.

Exactness: selection is exact (bit-identical to ``topk_positions_ref`` on the same bf16 scores).
Scores: the q.k dot (J terms) and the head sum (I terms) are f32 sums in another order than
XLA's (tensor cores; the pool kernel's head sum too), so where an f32 value lies next to a bf16
rounding boundary one head's bf16(q.k) or the final bf16 can round the other way: rare (measured
on an H200: 3e-8 of the scores at T=256, N=128k; none in interpret mode); the tests bound the
difference by one bf16 ulp of each head's product plus one of the score. NaN scores unsupported.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from deepinfer_jax.kernels_pallas import indexer_topk_ref, ops

_NEG_INF = float("-inf")


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _pow2_floor(n: int) -> int:
    return 1 << max(0, int(n).bit_length() - 1)


def _cdiv(a, b):
    return (a + b - 1) // b


def _params(num_warps: int, num_stages: int):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


# ----------------------------------------------------------------------------------- scoring


def _products(s, w, interpret: bool):
    """``bf16(relu(bf16(s)) * w)`` for f32 dots ``s [BN, H]`` and head weights ``w [H]``.

    relu before the rounding (equal: rounding is monotone and keeps 0) saves a bf16 round trip;
    with bf16 weights the product is a bf16 x bf16 multiply, correctly rounded, i.e. exactly the
    reference's ``bf16(f32(r) * f32(w))`` (the f32 product of two bf16 is exact).
    Interpret mode: XLA:CPU's YNNPACK fusion of such epilogues (some shapes) gets the bf16
    roundings wrong; barriers keep each rounding a separate op there. Not emitted for the GPU.
    """
    bar = lax.optimization_barrier if interpret else (lambda x: x)
    r = bar(jnp.maximum(s, 0.0).astype(jnp.bfloat16))
    if w.dtype == jnp.bfloat16:
        return bar(r * w[None, :])
    return bar((r.astype(jnp.float32) * w.astype(jnp.float32)[None, :]).astype(jnp.bfloat16))


def _score_tile(q_IJ, w_I, kt_NJ, vis_N, interpret: bool = False):
    """bf16 scores of one tile, the reference's arithmetic (f32 sums in a different order)."""
    prod = _products(plgpu.dot(kt_NJ, q_IJ, trans_b=True), w_I, interpret)  # [BN, I]
    sc = jnp.sum(prod.astype(jnp.float32), axis=1).astype(jnp.bfloat16)
    return jnp.where(vis_N, sc, _NEG_INF).astype(jnp.bfloat16)


def _score_kernel(nvis_ref, q_ref, w_ref, k_ref, o_ref, *, N: int, BN: int, TPP: int, interpret: bool):
    """Keys gathered per token ``[T, N, J]``: program (t, p) scores token t on TPP tiles."""
    t = pl.program_id(0)
    start = pl.program_id(1) * (BN * TPP)
    nv = jnp.minimum(nvis_ref[t], N)
    n_vis_tiles = jnp.clip((nv - start + BN - 1) // BN, 0, TPP)
    q = plgpu.load(q_ref.at[t])  # [I, J] bf16
    w = plgpu.load(w_ref.at[t])  # [I]
    ar = jnp.arange(BN, dtype=jnp.int32)

    def visible_tile(i, carry):
        n0 = start + i * BN
        pos = n0 + ar
        vis = pos < nv
        kt = plgpu.load(k_ref.at[t, pl.ds(n0, BN), :], mask=vis[:, None], other=0)
        plgpu.store(o_ref.at[t, pl.ds(n0, BN)], _score_tile(q, w, kt, vis, interpret), mask=pos < N)
        return carry

    def hidden_tile(i, carry):
        n0 = start + i * BN
        plgpu.store(o_ref.at[t, pl.ds(n0, BN)], jnp.full((BN,), _NEG_INF, jnp.bfloat16), mask=n0 + ar < N)
        return carry

    lax.fori_loop(0, n_vis_tiles, visible_tile, 0)
    lax.fori_loop(n_vis_tiles, TPP, hidden_tile, 0)


def _score_pool_kernel(nvis_ref, trow_ref, q_ref, w_ref, entry_ref, pool_ref, *rest, T: int, I: int, N: int,
                       BN: int, TPP: int, TB: int, interpret: bool):
    """Keys in the pool; program (b, p) scores the TB tokens [b*TB, (b+1)*TB) on TPP tiles.

    The TB tokens' queries form one ``[G = TB*I, J]`` operand: ``S = keys[BN, J] @ Q.T`` gives all
    their heads at once, the bf16 epilogue runs on ``[BN, G]``, and the per-token head sums are a
    second tensor-core product with the block-diagonal ones matrix ``E[G, CP]`` (``E[h, c] = 1`` iff
    head column h belongs to token c), as in flash attention's ``P @ V``. When the TB tokens sit on
    one request row (prefill), each key tile is loaded once for all of them; a block straddling rows
    (decode batches) scores each token on its own keys with its own I columns (``Es[j]`` puts the
    sums in column j): the work of one token a program, TB times over.

    Coded pools (``rest = (scale_ref, o_ref)``): the pool holds e5m2 codes and ``scale_ref[P]`` a
    power of two per entry (``quant.pack_index_keys``). The codes convert to bf16 exactly in
    registers and run the same arithmetic; the entry's scale multiplies the f32 head sum before
    its bf16 rounding. That equals the reference on the decoded keys bit for bit: scaling by a
    power of two commutes with every bf16 rounding, the relu and the f32 sums of the reference
    (no value comes near the f32 range limits).
    """
    scale_ref, o_ref = rest if len(rest) == 2 else (None, rest[0])
    G = TB * I
    CP = max(16, TB)  # output columns (>= 16 for the MMA); column c < TB is token t0 + c
    t0 = pl.program_id(0) * TB
    start = pl.program_id(1) * (BN * TPP)
    grp = jnp.arange(G, dtype=jnp.int32) // I
    Q = plgpu.load(q_ref.at[pl.ds(t0 * I, G), :], mask=(t0 + grp < T)[:, None], other=0)  # [G, J] bf16
    W = plgpu.load(w_ref.at[pl.ds(t0 * I, G)], mask=t0 + grp < T, other=0)  # [G]
    oc = jnp.arange(CP, dtype=jnp.int32)
    live_o = (oc < TB) & (t0 + oc < T)
    tok_o = jnp.minimum(t0 + oc, T - 1)
    tok_st = jnp.where(live_o, t0 + oc, T)  # dead columns point out of bounds (never written)
    nv_o = jnp.where(live_o, jnp.minimum(plgpu.load(nvis_ref.at[tok_o]), N), 0)  # [CP]
    row_o = plgpu.load(trow_ref.at[tok_o])
    row0 = trow_ref[t0]
    uniform = jnp.sum((live_o & (row_o != row0)).astype(jnp.int32)) == 0
    nv_max = jnp.max(nv_o)
    E = (grp[:, None] == oc[None, :]).astype(jnp.bfloat16)  # [G, CP]
    n_vis_tiles = jnp.clip((nv_max - start + BN - 1) // BN, 0, TPP)
    ar = jnp.arange(BN, dtype=jnp.int32)
    arj = jnp.arange(q_ref.shape[1], dtype=jnp.int32)
    toks = [jnp.minimum(t0 + j, T - 1) for j in range(TB)]
    rows = [trow_ref[toks[j]] for j in range(TB)]
    nvs = [jnp.where(t0 + j < T, jnp.minimum(nvis_ref[toks[j]], N), 0) for j in range(TB)]
    if TB > 1:  # per-token operands of the straddling-rows path
        qs = [plgpu.load(q_ref.at[pl.ds(toks[j] * I, I), :]) for j in range(TB)]
        ws = [plgpu.load(w_ref.at[pl.ds(toks[j] * I, I)]) for j in range(TB)]
        Es = [jnp.broadcast_to((oc == j)[None, :], (I, CP)).astype(jnp.bfloat16) for j in range(TB)]

    def load_keys(row, n0, vis):  # -> (keys [BN, J] bf16, per-entry scales [BN] f32 or None)
        e = plgpu.load(entry_ref.at[row, pl.ds(n0, BN)], mask=vis, other=0)
        kt = plgpu.load(pool_ref.at[e[:, None], arj[None, :]], mask=vis[:, None], other=0.0).astype(jnp.bfloat16)
        sc = None if scale_ref is None else plgpu.load(scale_ref.at[e], mask=vis, other=1.0)
        return kt, sc

    def scaled(sums, sc):  # the entry scales (powers of two) on the f32 head sums [BN, CP]
        return sums if sc is None else sums * sc[:, None]

    def products(kt, q, w):  # bf16(relu(bf16(k . q)) * w) per head column: [BN, heads] bf16
        return _products(plgpu.dot(kt, q, trans_b=True), w, interpret)

    def finish(sums, n0):  # sums [BN, CP] f32 (head sums from the tensor cores)
        pos = n0 + ar
        sc = jnp.where(pos[:, None] < nv_o[None, :], sums.astype(jnp.bfloat16), _NEG_INF).astype(jnp.bfloat16)
        plgpu.store(o_ref.at[tok_st[None, :], pos[:, None]], sc, mask=(pos[:, None] < N) & live_o[None, :])

    def shared_tile(i, carry):
        n0 = start + i * BN
        kt, sc = load_keys(row0, n0, n0 + ar < nv_max)
        finish(scaled(plgpu.dot(products(kt, Q, W), E), sc), n0)
        return carry

    def own_tile(i, carry):  # token j: its own keys, its own I head columns, output column j
        n0 = start + i * BN
        sums = None
        for j in range(TB):
            kt, sc = load_keys(rows[j], n0, n0 + ar < nvs[j])
            part = scaled(plgpu.dot(products(kt, qs[j], ws[j]), Es[j]), sc)  # nonzero in column j only
            sums = part if sums is None else sums + part
        finish(sums, n0)
        return carry

    def hidden_tile(i, carry):
        pos = start + i * BN + ar
        plgpu.store(o_ref.at[tok_st[None, :], pos[:, None]], jnp.full((BN, CP), _NEG_INF, jnp.bfloat16),
                    mask=(pos[:, None] < N) & live_o[None, :])
        return carry

    if TB == 1:
        lax.fori_loop(0, n_vis_tiles, shared_tile, 0)
    else:
        lax.cond(uniform, lambda: lax.fori_loop(0, n_vis_tiles, shared_tile, 0),
                 lambda: lax.fori_loop(0, n_vis_tiles, own_tile, 0))
    lax.fori_loop(n_vis_tiles, TPP, hidden_tile, 0)


def _score_blocking(T: int, N: int, block_n: int | None, tiles_per_program: int | None):
    BN = block_n or 128
    BN = min(BN, max(16, _pow2_ceil(N)))
    n_tiles = _cdiv(N, BN)
    if tiles_per_program is None:
        # enough programs to fill the GPU several times, long enough loops to pipeline the loads
        tiles_per_program = max(1, min(16, _pow2_floor(max(1, (T * n_tiles) // 2048))))
    TPP = max(1, min(tiles_per_program, n_tiles))
    return BN, TPP, _cdiv(n_tiles, TPP)


def _i32_offsets_overflow(ref_like) -> bool:
    """Pallas' Triton lowering (jax 0.11.2) picks 64-bit element offsets only when an array has
    more than 2^32 *bytes*; a 1-byte array of 2^31 .. 2^32 elements gets signed 32-bit offsets
    that wrap (seen on an H200: half of the scores wrong on a 2^32-element e5m2 pool)."""
    return ref_like.dtype.itemsize == 1 and 2 ** 31 < int(ref_like.size) <= 2 ** 32


def _check_score_shapes(I: int, J: int):
    if I & (I - 1) or J & (J - 1) or I < 16 or J < 16:
        raise NotImplementedError(f"indexer scoring kernel needs power-of-2 heads/dims >= 16, got I={I}, J={J}")


@functools.partial(jax.jit, static_argnames=("interpret", "block_n", "tiles_per_program", "num_warps",
                                             "num_stages"))
def indexer_scores(q_TIJ, k_TNJ, w_TI, n_visible_T, *, interpret: bool = False, block_n: int | None = None,
                   tiles_per_program: int | None = None, num_warps: int = 4, num_stages: int = 3):
    """bf16 scores ``[T, N]``; keys already gathered per token ``[T, N, J]`` (as the model calls)."""
    T, I, J = q_TIJ.shape
    N = k_TNJ.shape[1]
    _check_score_shapes(I, J)
    BN, TPP, n_prog = _score_blocking(T, N, block_n, tiles_per_program)
    kernel = functools.partial(_score_kernel, N=N, BN=BN, TPP=TPP, interpret=bool(interpret))
    return pl.pallas_call(
        kernel,
        grid=(T, n_prog),
        out_shape=jax.ShapeDtypeStruct((T, N), jnp.bfloat16),
        compiler_params=_params(num_warps, num_stages),
        interpret=interpret,
        name="indexer_scores",
    )(n_visible_T.astype(jnp.int32), q_TIJ.astype(jnp.bfloat16), w_TI, k_TNJ.astype(jnp.bfloat16))


@functools.partial(jax.jit, static_argnames=("interpret", "block_n", "tiles_per_program", "tokens_per_program",
                                             "num_warps", "num_stages"))
def indexer_scores_pool(q_TIJ, pool_PJ, entry_RN, token_row_T, w_TI, n_visible_T, pool_scale_P=None, *,
                        interpret: bool = False, block_n: int | None = None, tiles_per_program: int | None = None,
                        tokens_per_program: int | None = None, num_warps: int = 4, num_stages: int = 3):
    """Same scores with keys read straight from the cache pool: token ``t``'s key ``j`` is
    ``pool_PJ[entry_RN[token_row_T[t], j]]`` (what the model materialises today as
    ``take(pool, entry)[token_row]``: ``T*N*J`` bf16 copied per call). Entries at or past
    ``n_visible`` are never read (may be garbage). With ``pool_scale_P`` the pool holds fp8
    codes and key p is ``pool_PJ[p] * pool_scale_P[p]`` (``quant.pack_index_keys``; half the key
    bytes of a bf16 pool, the same scores)."""
    if pool_scale_P is None:
        pool_PJ = pool_PJ.astype(jnp.bfloat16)
    elif pool_PJ.dtype not in (jnp.float8_e5m2, jnp.float8_e4m3fn) or pool_scale_P.shape != pool_PJ.shape[:1]:
        raise ValueError(f"indexer_scores_pool: coded pool {pool_PJ.dtype}{pool_PJ.shape} with scales "
                         f"{pool_scale_P.shape}: expected fp8 codes [P, J] and scales [P]")
    if _i32_offsets_overflow(pool_PJ):
        raise ValueError(f"indexer_scores_pool: pool {pool_PJ.dtype}{pool_PJ.shape} has {pool_PJ.size} elements: "
                         "Pallas' Triton lowering (jax 0.11.2) would address it with 32-bit offsets that "
                         "overflow; use the reference (ops does) or a pool of < 2^31 or > 2^32 bytes")
    T, I, J = q_TIJ.shape
    N = entry_RN.shape[1]
    _check_score_shapes(I, J)
    if tokens_per_program is None:
        # 64 head columns a program: measured best for one-row (prefill) blocks on an H200 (1.04 vs
        # 1.17 ms for one token a program at T=256, N=128k); blocks straddling rows (decode) pay
        # ~10% over one token a program: pass 1 when every token has its own request.
        tokens_per_program = max(1, 64 // I)
    TB = max(1, min(tokens_per_program, _pow2_ceil(T)))
    BN, TPP, n_prog = _score_blocking(_cdiv(T, TB), N, block_n or 64, tiles_per_program)
    kernel = functools.partial(_score_pool_kernel, T=T, I=I, N=N, BN=BN, TPP=TPP, TB=TB, interpret=bool(interpret))
    return pl.pallas_call(
        kernel,
        grid=(_cdiv(T, TB), n_prog),
        out_shape=jax.ShapeDtypeStruct((T, N), jnp.bfloat16),
        compiler_params=_params(num_warps, num_stages),
        interpret=interpret,
        name="indexer_scores_pool",
    )(n_visible_T.astype(jnp.int32), token_row_T.astype(jnp.int32), q_TIJ.astype(jnp.bfloat16).reshape(T * I, J),
      w_TI.reshape(T * I), entry_RN.astype(jnp.int32), pool_PJ,
      *(() if pool_scale_P is None else (pool_scale_P.astype(jnp.float32),)))


# --------------------------------------------------------------------------------- selection


def _key16(s):
    """Monotone 16-bit key of bf16 scores (int32): total order, -0 < +0; -inf (and -NaN) -> 0."""
    u = lax.bitcast_convert_type(s.astype(jnp.bfloat16), jnp.int16).astype(jnp.int32) & 0xFFFF
    key = jnp.where(u >= 0x8000, 0xFFFF - u, u + 0x8000)
    return jnp.where(key > 0x7F, key, 0)


def _hist256(digit, valid):
    """[16, 16] f32 histogram of the 8-bit ``digit`` (bin = 16 * row + col) over ``valid``."""
    ar16 = jnp.arange(16, dtype=jnp.int32)
    oh_hi = ((digit[:, None] >> 4) == ar16[None, :]) & valid[:, None]
    oh_lo = (digit[:, None] & 15) == ar16[None, :]
    return plgpu.dot(oh_hi.astype(jnp.bfloat16), oh_lo.astype(jnp.bfloat16), trans_a=True)


def _suffix_above(c16):
    """``above[a] = sum_{a' > a} c16[a']`` for a [16] vector."""
    ar16 = jnp.arange(16, dtype=jnp.int32)
    return jnp.sum(jnp.where(ar16[None, :] > ar16[:, None], c16[None, :], 0), axis=1)


def _find_digit(H, kk):
    """Bin (0..255) holding the kk-th largest of the histogram ``H`` [16, 16] (int32), and how many
    elements must still be taken from that bin (>= 1 if the total is >= kk)."""
    ar16 = jnp.arange(16, dtype=jnp.int32)
    R = jnp.sum(H, axis=1)  # per high nibble
    above_r = _suffix_above(R)
    a = jnp.sum((above_r >= kk).astype(jnp.int32))
    rem = kk - jnp.sum(jnp.where(ar16 == a, above_r, 0))
    row = jnp.sum(jnp.where(ar16[:, None] == a, H, 0), axis=0)
    above_c = _suffix_above(row)
    b = jnp.sum((above_c >= rem).astype(jnp.int32))
    rem = rem - jnp.sum(jnp.where(ar16 == b, above_c, 0))
    return a * 16 + b, rem


def _threshold(load_keys, n_tiles, k: int):
    """Exact k-th largest key over the entries ``load_keys(i)`` (key 0 = invalid, never counted).

    Returns ``(tau, need, n_valid)``: the entries to select are those with key > tau plus the first
    ``need`` with key == tau. If ``n_valid <= k``: ``tau = need = 0`` (select every valid entry).
    """
    def pass1(i, H):
        key = load_keys(i)
        return H + _hist256(key >> 8, key > 0)

    H1 = lax.fori_loop(0, n_tiles, pass1, jnp.zeros((16, 16), jnp.float32)).astype(jnp.int32)
    n_valid = jnp.sum(jnp.sum(H1, axis=1))
    d1, rem1 = _find_digit(H1, k)

    def pass2(i, H):
        key = load_keys(i)
        return H + _hist256(key & 255, (key > 0) & ((key >> 8) == d1))

    H2 = lax.fori_loop(0, n_tiles, pass2, jnp.zeros((16, 16), jnp.float32)).astype(jnp.int32)
    d2, need = _find_digit(H2, rem1)
    few = n_valid <= k
    tau = jnp.where(few, 0, d1 * 256 + d2)
    need = jnp.where(few, 0, need)
    return tau, need, n_valid


def _chunkmax_kernel(s_ref, m_ref, *, N: int, C: int, RA: int):
    """Max key of every chunk of C positions; program (t, p) covers chunks [p*RA, (p+1)*RA)."""
    t, p = pl.program_id(0), pl.program_id(1)
    rows = p * RA + jnp.arange(RA, dtype=jnp.int32)
    if C == 1:
        s = plgpu.load(s_ref.at[t, pl.ds(p * RA, RA)], mask=rows < N, other=_NEG_INF)
        mk = _key16(s)
    else:
        pos = rows[:, None] * C + jnp.arange(C, dtype=jnp.int32)[None, :]
        s = plgpu.load(s_ref.at[t, pos], mask=pos < N, other=_NEG_INF)
        mk = jnp.max(_key16(s), axis=1)
    plgpu.store(m_ref.at[t, pl.ds(p * RA, RA)], mk, mask=rows < _cdiv(N, C))


def _bound_kernel(m_ref, low_ref, *, NC: int, k: int, BH: int):
    """Per row: ``low`` = the exact k-th largest chunk max (1 if at most k chunks are valid). At
    least k positions have key >= low, so every top-k position does."""
    t = pl.program_id(0)
    arh = jnp.arange(BH, dtype=jnp.int32)

    def load_max(i):
        return plgpu.load(m_ref.at[t, pl.ds(i * BH, BH)], mask=i * BH + arh < NC, other=0)

    tau, _, n_valid = _threshold(load_max, _cdiv(NC, BH), k)
    low_ref[t] = jnp.where(n_valid > k, tau, 1)


def _candidates_kernel(low_ref, s_ref, cand_ref, cnt_ref, *, N: int, SEG: int, BB: int, skip_empty: bool):
    """Program (t, g): positions of segment g of row t with key >= low, ascending, into
    ``cand[t, g*SEG + i]``; their count into ``cnt[t, g]`` (a segment's list never overflows)."""
    t, g = pl.program_id(0), pl.program_id(1)
    low = low_ref[t]
    arb = jnp.arange(BB, dtype=jnp.int32)

    def body(i, m):
        pos = g * SEG + i * BB + arb
        sc = plgpu.load(s_ref.at[t, pl.ds(g * SEG + i * BB, BB)], mask=pos < N, other=_NEG_INF)
        c = (_key16(sc) >= low) & (pos < N)
        ci = c.astype(jnp.int32)
        n_c = jnp.sum(ci)

        def compact():
            off = m + jnp.cumsum(ci) - ci
            plgpu.store(cand_ref.at[t, jnp.where(c, g * SEG + off, N + SEG)], pos, mask=c)

        if skip_empty:
            lax.cond(n_c > 0, compact, lambda: None)
        else:
            compact()
        return m + n_c

    cnt_ref[t, g] = lax.fori_loop(0, SEG // BB, body, jnp.int32(0))


def _lanes(size: int, dim: int):
    """Index of ``size`` lanes from 0 into a dimension of ``dim`` entries, for a masked load or
    store: a slice where it fits, else lane indices clamped to ``dim - 1`` (the lanes past it are
    masked off; JAX >= 0.12 rejects a static slice that runs past the dimension, masked or not)."""
    return pl.ds(0, size) if size <= dim else jnp.minimum(jnp.arange(size, dtype=jnp.int32), dim - 1)


def _select_kernel(s_ref, cand_ref, cnt_ref, o_ref, *, k: int, KP: int, BC: int, S: int, SP: int, SEG: int):
    """Per row: exact threshold over the candidates (the segments' lists, in order), then an
    order-preserving compaction of the selected positions into ``o[t, :k]``."""
    t = pl.program_id(0)
    ars = jnp.arange(SP, dtype=jnp.int32)
    cnt = plgpu.load(cnt_ref.at[t, _lanes(SP, S)], mask=ars < S, other=0)  # [SP]
    incl = jnp.cumsum(cnt)
    pre = incl - cnt
    n_ent = jnp.sum(cnt)
    arc = jnp.arange(BC, dtype=jnp.int32)

    def load_entries(i):  # entry e -> (segment, offset) through the prefix sums of the counts
        e = i * BC + arc
        inr = e < n_ent
        seg = jnp.sum((e[:, None] >= incl[None, :]).astype(jnp.int32), axis=1)
        off = e - jnp.sum(jnp.where(ars[None, :] == seg[:, None], pre[None, :], 0), axis=1)
        pos = plgpu.load(cand_ref.at[t, jnp.where(inr, seg * SEG + off, 0)], mask=inr, other=0)
        sc = plgpu.load(s_ref.at[t, pos], mask=inr, other=_NEG_INF)
        return pos, _key16(sc)

    n_tiles = (n_ent + BC - 1) // BC
    tau, need, _ = _threshold(lambda i: load_entries(i)[1], n_tiles, k)

    def body(i, carry):
        gt_before, eq_before = carry
        pos, key = load_entries(i)
        gt = key > tau
        eq = (key == tau) & (key > 0)
        gti, eqi = gt.astype(jnp.int32), eq.astype(jnp.int32)
        v = gti + eqi * 65536  # both exclusive counts from one scan (BC < 65536)
        excl = jnp.cumsum(v) - v
        eq_rank = eq_before + (excl >> 16)
        sel = gt | (eq & (eq_rank < need))
        off = gt_before + (excl & 0xFFFF) + jnp.minimum(eq_rank, need)
        plgpu.store(o_ref.at[t, jnp.where(sel, off, k)], pos, mask=sel)
        return gt_before + jnp.sum(gti), eq_before + jnp.sum(eqi)

    gt_n, eq_n = lax.fori_loop(0, n_tiles, body, (jnp.int32(0), jnp.int32(0)))
    total = gt_n + jnp.minimum(eq_n, need)
    ark = jnp.arange(KP, dtype=jnp.int32)
    plgpu.store(o_ref.at[t, _lanes(KP, k)], jnp.full((KP,), -1, jnp.int32), mask=(ark >= total) & (ark < k))


def _select_config(N: int, k: int, chunk: int | None = None, seg: int | None = None):
    """(C, NC, RA, SEG, S): chunk size of the max bound (NC = N/C >= 2k chunks keep it tight:
    expected -NC*ln(1 - k/NC) <= 1.4k candidates on i.i.d. scores), chunks per chunk-max program,
    positions per candidate-compaction program and segments per row."""
    C = chunk or max(1, min(128, _pow2_floor(max(1, N // (2 * k)))))
    NC = _cdiv(N, C)
    RA = max(1, min(4096 // C, _pow2_ceil(NC)))
    SEG = seg or min(8192, max(16, _pow2_ceil(N)))
    return C, NC, RA, SEG, _cdiv(N, SEG)


def _chunk_max(score_TN, C: int, NC: int, RA: int, interpret: bool, num_warps: int = 4):
    T, N = score_TN.shape
    return pl.pallas_call(
        functools.partial(_chunkmax_kernel, N=N, C=C, RA=RA),
        grid=(T, _cdiv(NC, RA)),
        out_shape=jax.ShapeDtypeStruct((T, NC), jnp.int32),
        compiler_params=_params(num_warps, 3),
        interpret=interpret,
        name="indexer_topk_chunkmax",
    )(score_TN)


def _bound(maxk_TC, k: int, interpret: bool, num_warps: int = 4, BH: int = 256):
    T, NC = maxk_TC.shape
    return pl.pallas_call(
        functools.partial(_bound_kernel, NC=NC, k=k, BH=min(BH, max(16, _pow2_ceil(NC)))),
        grid=(T,),
        out_shape=jax.ShapeDtypeStruct((T,), jnp.int32),
        compiler_params=_params(num_warps, 3),
        interpret=interpret,
        name="indexer_topk_bound",
    )(maxk_TC)


def _candidates(low_T, score_TN, SEG: int, interpret: bool, num_warps: int = 4, BB: int = 2048,
                skip_empty: bool = True):
    T, N = score_TN.shape
    S = _cdiv(N, SEG)
    BB = min(BB, SEG)
    return pl.pallas_call(
        functools.partial(_candidates_kernel, N=N, SEG=SEG, BB=BB, skip_empty=skip_empty),
        grid=(T, S),
        out_shape=(jax.ShapeDtypeStruct((T, S * SEG), jnp.int32), jax.ShapeDtypeStruct((T, S), jnp.int32)),
        compiler_params=_params(num_warps, 3),
        interpret=interpret,
        name="indexer_topk_candidates",
    )(low_T, score_TN)


def _select(score_TN, cand_TX, cnt_TS, k: int, SEG: int, interpret: bool, num_warps: int = 4, BC: int = 256):
    T, N = score_TN.shape
    S = cnt_TS.shape[1]
    return pl.pallas_call(
        functools.partial(_select_kernel, k=k, KP=_pow2_ceil(k), BC=BC, S=S, SP=max(2, _pow2_ceil(S)), SEG=SEG),
        grid=(T,),
        out_shape=jax.ShapeDtypeStruct((T, k), jnp.int32),
        compiler_params=_params(num_warps, 3),
        interpret=interpret,
        name="indexer_topk_select",
    )(score_TN, cand_TX, cnt_TS)


@functools.partial(jax.jit, static_argnames=("k", "interpret", "chunk", "seg", "num_warps"))
def topk_positions(score_TN, k: int, *, interpret: bool = False, chunk: int | None = None, seg: int | None = None,
                   num_warps: int = 4):
    """Top-``k`` positions of bf16 scores ``[T, N]``, sorted ascending, -1 where -inf/unused
    (exactly ``topk_positions_ref``). Non-bf16 scores go to the reference (casting would merge
    distinct values). ``chunk``/``seg``: tuning and tests only."""
    if score_TN.dtype != jnp.bfloat16:
        return indexer_topk_ref.topk_positions_ref(score_TN, k)
    N = score_TN.shape[1]
    C, NC, RA, SEG, _ = _select_config(N, k, chunk, seg)
    low = _bound(_chunk_max(score_TN, C, NC, RA, interpret, num_warps), k, interpret, num_warps)
    cand, cnt = _candidates(low, score_TN, SEG, interpret, num_warps)
    return _select(score_TN, cand, cnt, k, SEG, interpret, num_warps)


def indexer_topk(q_TIJ, k_TNJ, w_TI, n_visible_T, k_top: int, *, interpret: bool = False):
    """Scores + top-k in one call (two kernel groups; no candidate mask in between)."""
    return topk_positions(indexer_scores(q_TIJ, k_TNJ, w_TI, n_visible_T, interpret=interpret), k_top,
                          interpret=interpret)


def indexer_topk_pool(q_TIJ, pool_PJ, entry_RN, token_row_T, w_TI, n_visible_T, k_top: int, pool_scale_P=None, *,
                      interpret: bool = False):
    s = indexer_scores_pool(q_TIJ, pool_PJ, entry_RN, token_row_T, w_TI, n_visible_T, pool_scale_P,
                            interpret=interpret)
    return topk_positions(s, k_top, interpret=interpret)


# ------------------------------------------------------------------------- ops registration


def _heads_unsupported(q_TIJ) -> str | None:
    I, J = q_TIJ.shape[1:]
    if I & (I - 1) or J & (J - 1) or I < 16 or J < 16:
        return f"index heads {I} x head_dim {J}: both must be powers of two >= 16"
    return None


def _scores_op(q_TIJ, k_TNJ, w_TI, n_visible_T):
    why = _heads_unsupported(q_TIJ)
    if why is not None:
        ops.note_fallback("indexer_scores", why)
        return indexer_topk_ref.indexer_scores_ref(q_TIJ, k_TNJ, w_TI, n_visible_T)
    return indexer_scores(q_TIJ, k_TNJ, w_TI, n_visible_T)


def _scores_pool_op(q_TIJ, pool_PJ, entry_RN, token_row_T, w_TI, n_visible_T, pool_scale_P=None):
    why = _heads_unsupported(q_TIJ)
    if why is None and _i32_offsets_overflow(pool_PJ):
        why = f"a 1-byte pool of {pool_PJ.size} elements overflows 32-bit offsets"
    if why is not None:
        ops.note_fallback("indexer_scores_pool", why)
        return indexer_topk_ref.indexer_scores_pool_ref(q_TIJ, pool_PJ, entry_RN, token_row_T, w_TI, n_visible_T,
                                                        pool_scale_P)
    return indexer_scores_pool(q_TIJ, pool_PJ, entry_RN, token_row_T, w_TI, n_visible_T, pool_scale_P)


def _topk_op(score_TN, k: int):
    if score_TN.dtype != jnp.bfloat16:
        ops.note_fallback("topk_positions", f"{score_TN.dtype} scores (the kernel selects on bf16)")
    return topk_positions(score_TN, k)


def _register(platform: str = "gpu") -> None:
    """Registered on import (``ops`` imports this module on first use on a GPU)."""
    from deepinfer_jax.kernels_pallas import ops

    ops.register_kernel("indexer_scores", platform, _scores_op)
    ops.register_kernel("indexer_scores_pool", platform, _scores_pool_op)
    ops.register_kernel("topk_positions", platform, _topk_op)


_register()
