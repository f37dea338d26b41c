"""fp8 / fp4 numerics of DeepSeek-V4.1, in jnp.

Two families:

* **Activation quantize-dequantize** (QDQ), exactly as the reference kernels round:
  ``act_quant_fp8`` (blocks of 32, power-of-two scale ``2^ceil(log2(amax/448))``, amax floor
  1e-4, round-to-nearest-even, saturate at 448) and ``act_quant_fp4`` (e2m1 with either a
  power-of-two scale per 32 — indexer q/k — or an e4m3 scale per 16 — compressed KV). Both take
  bf16 and return bf16 holding exactly the dequantized values.
* **Stored weights**: fp8 e4m3 with ue8m0 32x32 block scales, and fp4 e2m1 packed two per byte
  (even element in the low nibble) with a ue8m0 scale per 32 inputs. Scales are kept as raw
  exponent bytes (uint8, value ``2^(e-127)``). ``dequant_*`` turn them into bf16 *exactly*
  (an e4m3 or e2m1 value times a power of two is representable in bf16), so a matmul of a
  QDQ'd activation with a dequantized weight equals the reference's block-scaled GEMM up to
  fp32 summation order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

FP8_MAX = 448.0
FP4_MAX = 6.0
_FP8_MAX_INV = np.float32(1.0 / FP8_MAX)
_FP4_MAX_INV = np.float32(1.0 / FP4_MAX)

E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
# signed table indexed by the 4-bit code (bit 3 = sign)
FP4_TABLE = np.concatenate([E2M1_GRID, -E2M1_GRID])
# round-to-nearest-even boundaries between consecutive e2m1 magnitudes; at an exact tie the
# value goes up only when the upper code is even (0.75 -> 1, 1.75 -> 2, 3.5 -> 4)
_E2M1_MIDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_TIE_UP = (False, True, False, True, False, True, False)


def pow2_ceil_scale(amax_f32: jax.Array, max_inv: np.float32) -> jax.Array:
    """``2^ceil(log2(amax * max_inv))`` from the float's bits (exponent + [mantissa != 0])."""
    x = amax_f32.astype(jnp.float32) * max_inv
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    exp = (bits >> 23) & 0xFF
    man = bits & ((1 << 23) - 1)
    log2_ceil = exp - 127 + (man != 0).astype(jnp.int32)
    return jax.lax.bitcast_convert_type((log2_ceil + 127) << 23, jnp.float32)


def _blocks(x: jax.Array, block: int) -> jax.Array:
    n = x.shape[-1]
    if n % block:
        raise ValueError(f"last dim {n} is not a multiple of the quantization block {block}")
    return x.astype(jnp.float32).reshape(*x.shape[:-1], n // block, block)


def act_quant_fp8_codes(x: jax.Array, block: int = 32) -> tuple[jax.Array, jax.Array]:
    """fp8 e4m3 quantization of activations, per ``block`` along the last dim (reference
    ``act_quant``): e4m3 codes ``[..., K]`` and power-of-two f32 scales ``[..., K/block]``."""
    xg = _blocks(x, block)
    amax = jnp.maximum(jnp.max(jnp.abs(xg), axis=-1, keepdims=True), 1e-4)
    s = pow2_ceil_scale(amax, _FP8_MAX_INV)
    q = jnp.clip(xg / s, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return q.reshape(x.shape), s[..., 0]


def act_quant_fp8(x: jax.Array, block: int = 32) -> jax.Array:
    """fp8 e4m3 QDQ of activations, per ``block`` along the last dim (reference ``act_quant``).
    Gradient: the identity (straight-through, see ``_straight_through``)."""
    return _qdq_fp8(x, block)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _qdq_fp8(x: jax.Array, block: int) -> jax.Array:
    q, s = act_quant_fp8_codes(x, block)
    return (_blocks(q, block).astype(jnp.float32) * s[..., None]).reshape(x.shape).astype(x.dtype)


@_qdq_fp8.defjvp
def _qdq_fp8_jvp(block, primals, tangents):
    return _straight_through(_qdq_fp8(primals[0], block), tangents[0])


def _straight_through(y: jax.Array, t_x: jax.Array):
    """The JVP of a QDQ: the primal as computed, the input's tangent unchanged. Without it the
    cotangent would pass through the e4m3 / e2m1 code arrays and be rounded to their grids, with
    no scale: gradients below e4m3's smallest subnormal (2^-9) became exactly 0, and e2m1 codes
    (integer indices) carry none. The forward computation is untouched."""
    return y, t_x.astype(y.dtype)


def e2m1_code(v: jax.Array) -> jax.Array:
    """fp32 in [-6, 6] -> the 4-bit e2m1 code of its nearest value (round-to-nearest-even;
    bit 3 = sign, kept for -0.0), int32: ``FP4_TABLE[code]`` is the rounded value."""
    mag = jnp.abs(v)
    code = jnp.zeros(v.shape, jnp.int32)
    for mid, up in zip(_E2M1_MIDS, _E2M1_TIE_UP):
        code = code + (mag > mid) + ((mag == mid) & up)
    return code | (jnp.signbit(v).astype(jnp.int32) << 3)


def e2m1_round(v: jax.Array) -> jax.Array:
    """fp32 in [-6, 6] -> nearest e2m1 value (round-to-nearest-even), sign kept."""
    return jnp.asarray(FP4_TABLE)[e2m1_code(v)]


def act_quant_fp4(x: jax.Array, block: int = 32, scale_fmt: str = "ue8m0") -> jax.Array:
    """fp4 e2m1 QDQ (reference ``fp4_act_quant`` in place). ``scale_fmt``: ``ue8m0``
    (power-of-two scale, indexer q/k) or ``e4m3`` (amax/6 rounded to e4m3, compressed KV).
    Gradient: the identity (straight-through)."""
    if scale_fmt not in ("ue8m0", "e4m3"):
        raise ValueError(f"scale_fmt={scale_fmt!r}: expected 'ue8m0' or 'e4m3'")
    return _qdq_fp4(x, block, scale_fmt)


def act_quant_fp4_values(x: jax.Array, block: int = 32, scale_fmt: str = "ue8m0") -> tuple[jax.Array, jax.Array]:
    """The two factors of ``act_quant_fp4``: e2m1 values (f32 ``[.., K]``, rounded) and the f32
    scales ``[.., K/block]``; their product is the QDQ."""
    code, s = act_quant_fp4_codes(x, block, scale_fmt)
    return jnp.asarray(FP4_TABLE)[code], s


def act_quant_fp4_codes(x: jax.Array, block: int = 32, scale_fmt: str = "ue8m0") -> tuple[jax.Array, jax.Array]:
    """``act_quant_fp4_values`` as 4-bit e2m1 codes (int32, ``FP4_TABLE`` indices) and scales."""
    xg = _blocks(x, block)
    amax = jnp.max(jnp.abs(xg), axis=-1, keepdims=True)
    if scale_fmt == "e4m3":
        amax = jnp.maximum(amax, 6 * 2.0**-9)
        s = jnp.clip(amax / FP4_MAX, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn).astype(jnp.float32)
    elif scale_fmt == "ue8m0":
        amax = jnp.maximum(amax, 6 * 2.0**-126)
        s = pow2_ceil_scale(amax, _FP4_MAX_INV)
    else:
        raise ValueError(f"scale_fmt={scale_fmt!r}: expected 'ue8m0' or 'e4m3'")
    code = e2m1_code(jnp.clip(xg / s, -FP4_MAX, FP4_MAX))
    return code.reshape(x.shape), s[..., 0]


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _qdq_fp4(x: jax.Array, block: int, scale_fmt: str) -> jax.Array:
    v, s = act_quant_fp4_values(x, block, scale_fmt)
    return (_blocks(v, block) * s[..., None]).reshape(x.shape).astype(x.dtype)


@_qdq_fp4.defjvp
def _qdq_fp4_jvp(block, scale_fmt, primals, tangents):
    return _straight_through(_qdq_fp4(primals[0], block, scale_fmt), tangents[0])


# ----------------------------------------------------------------------------- index-key storage
INDEX_KEY_DTYPE = jnp.float8_e5m2
INDEX_KEY_DTYPES = ("bf16", "fp8")  # index-key cache formats: bf16 keys, or codes from pack_index_keys
_E5M2_TOP = 14  # a row's amax lands in [2^14, 2^15): under e5m2's max 57344 = 1.75 * 2^15


def pack_index_keys(k_NJ: jax.Array) -> tuple[jax.Array, jax.Array]:
    """fp4-QDQ'd index keys -> (e5m2 codes ``[..., J]``, f32 power-of-two row scales ``[...]``).

    The indexer's keys are e2m1 values times a power of two per 32 (``act_quant_fp4(..., 32,
    "ue8m0")``): two significant bits each. One power-of-two scale per key row ``2^E`` (``E`` from
    the row's amax, so that amax / 2^E lies in [2^14, 2^15)) leaves codes that e5m2 (three
    significant bits, 2^-16 .. 57344) holds *exactly* whenever every nonzero entry of the row is
    at least amax * 2^-29 (29 binades; k_norm'd keys span a few). Smaller entries would round on
    the e5m2 subnormal grid (towards zero): their share of any q . k term is below 2^-29 of the
    row's largest. Within that condition ``unpack_index_keys`` returns the bf16 keys bit for bit:
    half the bytes of bf16 storage, the same scores. A zero row gets scale 1."""
    kf = k_NJ.astype(jnp.float32)
    amax = jnp.max(jnp.abs(kf), axis=-1)
    _, ex = jnp.frexp(amax)  # amax = m * 2^ex, m in [0.5, 1): floor(log2(amax)) = ex - 1
    e = jnp.where(amax > 0, jnp.clip(ex - 1 - _E5M2_TOP, -126, 127 - 15), 0)
    codes = jnp.ldexp(kf, -e[..., None]).astype(INDEX_KEY_DTYPE)
    return codes, jnp.ldexp(jnp.ones_like(amax), e)


def unpack_index_keys(codes_NJ: jax.Array, scale_N: jax.Array, dtype=jnp.bfloat16) -> jax.Array:
    """Inverse of ``pack_index_keys``: ``codes * scale`` (exact: a power-of-two scale)."""
    return (codes_NJ.astype(jnp.float32) * scale_N.astype(jnp.float32)[..., None]).astype(dtype)


# ----------------------------------------------------------------------------- stored weights
def e8m0_to_f32(e: jax.Array) -> jax.Array:
    """Raw ue8m0 exponent bytes -> fp32 powers of two (2^(e-127))."""
    return jax.lax.bitcast_convert_type(e.astype(jnp.int32) << 23, jnp.float32)


def dequant_fp8_block(w: jax.Array, scale_e8m0: jax.Array, block: int = 32, dtype=jnp.bfloat16) -> jax.Array:
    """e4m3 ``w[..., out, in]`` with ue8m0 ``scale[..., ceil(out/b), ceil(in/b)]`` -> ``dtype``."""
    out, inp = w.shape[-2:]
    s = e8m0_to_f32(scale_e8m0)
    s = jnp.repeat(jnp.repeat(s, block, axis=-2), block, axis=-1)[..., :out, :inp]
    return (w.astype(jnp.float32) * s).astype(dtype)


def unpack_fp4(packed: jax.Array) -> jax.Array:
    """uint8/int8 ``[..., n/2]`` (two e2m1 codes a byte, even element low) -> fp32 ``[..., n]``."""
    b = packed.astype(jnp.uint8)
    table = jnp.asarray(FP4_TABLE)
    lo = table[(b & 0x0F).astype(jnp.int32)]
    hi = table[(b >> 4).astype(jnp.int32)]
    return jnp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def dequant_fp4(packed: jax.Array, scale_e8m0: jax.Array, block: int = 32, dtype=jnp.bfloat16) -> jax.Array:
    """fp4 ``[..., out, in/2]`` with ue8m0 ``scale[..., out, in/block]`` -> ``dtype [..., out, in]``."""
    v = unpack_fp4(packed)
    n = v.shape[-1]
    v = v.reshape(*v.shape[:-1], n // block, block) * e8m0_to_f32(scale_e8m0)[..., None]
    return v.reshape(*v.shape[:-2], n).astype(dtype)
