"""Numpy reference of the DeepSeek-V4.1 checkpoint storage formats (no JAX).

* **ue8m0 scales** (file dtype ``F8_E8M0``, held as raw ``uint8`` exponent bytes ``e``):
  value ``2**(e - 127)``; ``e == 255`` is NaN.
* **fp8 block weights**: ``float8_e4m3fn`` values ``[out, in]`` with one ue8m0 scale per
  ``32 x 32`` block, scale array ``[ceil(out/32), ceil(in/32)]``; real weight =
  ``fp8 * scale``. Quantisation uses the power-of-two scale ``s = 2**ceil(log2(amax / 448))``
  (amax floored at 1e-4, computed in float32 as the reference does), rounds ``w / s`` to
  nearest-even e4m3 and saturates at +-448. The Engram tables use the same format with
  ``1 x 32`` blocks (one scale per row and 32 columns): ``block=(1, 32)``.
* **fp4 e2m1 experts** (file dtype ``I8``): magnitudes ``[0, .5, 1, 1.5, 2, 3, 4, 6]`` (codes
  0..7), sign in bit 3; two codes per byte, **the even element in the low nibble**; packed
  ``[out, in/2]`` with one ue8m0 scale per row and 32 columns, ``[out, ceil(in/32)]``.
  Quantisation: ``s = 2**ceil(log2(amax / 6))`` per 32 (amax floor 1e-4), round to the nearest
  grid value with ties to the even code (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4,
  5->4), saturate at 6. The sign of ``w`` (``signbit``, so -0.0 too) sets bit 3 even when the
  magnitude rounds to 0.

Round trips: ``dequantize(quantize(x))`` is exact when ``x`` is already representable; and
``quantize(dequantize(q, s))`` reproduces ``(q, s)`` bit for bit whenever ``s`` is the minimal
power-of-two scale for the block, i.e. when the block's largest |code| exceeds half the format
maximum (> 224 for e4m3, > 3 for e2m1). Otherwise the re-quantised scale is smaller and the
codes larger, with identical dequantised values.
"""

from __future__ import annotations

from typing import Sequence

import ml_dtypes
import numpy as np

__all__ = [
    "FP8_MAX",
    "FP4_MAX",
    "FP4_GRID",
    "AMAX_FLOOR",
    "e8m0_to_float",
    "float_to_e8m0",
    "pow2_scale",
    "quantize_fp8_block",
    "dequantize_fp8_block",
    "quantize_fp4",
    "dequantize_fp4",
    "fp4_codes",
    "fp4_codes_to_float",
    "pack_fp4_codes",
    "unpack_fp4_codes",
]

FP8_MAX = 448.0
FP4_MAX = 6.0
AMAX_FLOOR = 1e-4
FP4_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
# signed value of each 4-bit code 0..15
_FP4_VALUES = np.concatenate([FP4_GRID, -FP4_GRID]).astype(np.float32)
_FP4_MIDS = ((FP4_GRID[1:] + FP4_GRID[:-1]) / 2).astype(np.float32)  # 0.25 .. 5.0


# ----------------------------------------------------------------------------- ue8m0


def e8m0_to_float(u8: np.ndarray) -> np.ndarray:
    """Raw ue8m0 exponent bytes -> float32 ``2**(e-127)`` (255 -> NaN)."""
    e = np.asarray(u8)
    if e.dtype == np.dtype(ml_dtypes.float8_e8m0fnu):
        e = e.view(np.uint8)
    if e.dtype != np.uint8:
        raise ValueError(f"e8m0 exponents must be uint8, got {e.dtype}")
    out = np.ldexp(np.float32(1.0), np.minimum(e.astype(np.int32), 254) - 127).astype(np.float32)
    return np.where(e == 255, np.float32(np.nan), out).astype(np.float32)


def float_to_e8m0(x: np.ndarray) -> np.ndarray:
    """Power-of-two float -> ue8m0 exponent byte (uint8). Raises on non-powers of two or
    values outside ``[2**-127, 2**127]``."""
    x = np.asarray(x, dtype=np.float32)
    m, ex = np.frexp(x)  # x = m * 2**ex, m in [0.5, 1)
    if not np.all(m == 0.5):
        bad = x[m != 0.5].reshape(-1)[0]
        raise ValueError(f"ue8m0 scales must be positive powers of two, got {bad!r}")
    e = ex.astype(np.int64) - 1 + 127
    if e.size and (e.min() < 0 or e.max() > 254):
        raise ValueError(f"ue8m0 exponent out of range [-127, 127]: {int(e.min()) - 127}..{int(e.max()) - 127}")
    return e.astype(np.uint8)


def _ceil_log2(x: np.ndarray) -> np.ndarray:
    """Exact ceil(log2(x)) for positive float32 x (from the binary exponent, no libm)."""
    m, ex = np.frexp(np.asarray(x, dtype=np.float32))
    return ex.astype(np.int32) - (m == 0.5).astype(np.int32)


def pow2_scale(amax: np.ndarray, fmt_max: float) -> np.ndarray:
    """float32 ``2**ceil(log2(max(amax, 1e-4) / fmt_max))`` (division in float32)."""
    a = np.maximum(np.asarray(amax, dtype=np.float32), np.float32(AMAX_FLOOR))
    r = (a / np.float32(fmt_max)).astype(np.float32)
    return np.ldexp(np.float32(1.0), _ceil_log2(r)).astype(np.float32)


# ----------------------------------------------------------------------------- fp8 blocks


def _blocks(block: int | Sequence[int]) -> tuple[int, int]:
    if isinstance(block, (int, np.integer)):
        return int(block), int(block)
    bo, bi = (int(b) for b in block)
    return bo, bi


def _pad2(w: np.ndarray, bo: int, bi: int) -> np.ndarray:
    o, i = w.shape
    po, pi = -o % bo, -i % bi
    if po or pi:
        w = np.pad(w, ((0, po), (0, pi)))
    return w


def quantize_fp8_block(w: np.ndarray, block: int | Sequence[int] = 32) -> tuple[np.ndarray, np.ndarray]:
    """float ``[out, in]`` -> (float8_e4m3fn ``[out, in]``, ue8m0 uint8
    ``[ceil(out/bo), ceil(in/bi)]``). ``block`` is 32 (32x32) or ``(bo, bi)``."""
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"quantize_fp8_block needs a 2-D array, got shape {w.shape}")
    bo, bi = _blocks(block)
    o, i = w.shape
    wp = _pad2(w, bo, bi)
    nbo, nbi = wp.shape[0] // bo, wp.shape[1] // bi
    blk = wp.reshape(nbo, bo, nbi, bi)
    amax = np.abs(blk).max(axis=(1, 3))
    s = pow2_scale(amax, FP8_MAX)  # [nbo, nbi]
    q = blk / s[:, None, :, None]
    q = np.clip(q, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    q = q.reshape(wp.shape)[:o, :i]
    return np.ascontiguousarray(q), float_to_e8m0(s)


def dequantize_fp8_block(w: np.ndarray, scale: np.ndarray, block: int | Sequence[int] = 32) -> np.ndarray:
    """(fp8 ``[out, in]``, ue8m0 ``[ceil(out/bo), ceil(in/bi)]``) -> float32 ``[out, in]``.
    ``block`` is 32 (32x32, Linear weights) or ``(bo, bi)`` (``(1, 32)`` for Engram tables)."""
    w = np.asarray(w)
    scale = np.asarray(scale)
    if w.ndim != 2 or scale.ndim != 2:
        raise ValueError(f"dequantize_fp8_block needs 2-D arrays, got {w.shape} and {scale.shape}")
    o, i = w.shape
    bo, bi = _blocks(block)
    if scale.shape != (-(-o // bo), -(-i // bi)):
        raise ValueError(f"scale shape {scale.shape} does not fit weight {w.shape} with blocks {bo}x{bi}")
    s = e8m0_to_float(scale)
    s_full = np.repeat(np.repeat(s, bo, axis=0), bi, axis=1)[:o, :i]
    return (w.astype(np.float32) * s_full).astype(np.float32)


# ----------------------------------------------------------------------------- fp4 e2m1


def fp4_codes(x: np.ndarray) -> np.ndarray:
    """float32 values (already divided by the scale) -> 4-bit e2m1 codes (uint8 0..15), round
    to nearest, ties to even code, saturating at 6."""
    x = np.asarray(x, dtype=np.float32)
    a = np.minimum(np.abs(x), np.float32(FP4_MAX))
    lo = np.searchsorted(_FP4_MIDS, a, side="left")  # ties -> lower code
    hi = np.searchsorted(_FP4_MIDS, a, side="right")  # ties -> upper code
    mag = np.where((lo != hi) & (lo % 2 == 1), hi, lo).astype(np.uint8)
    return (mag | (np.signbit(x).astype(np.uint8) << 3)).astype(np.uint8)


def fp4_codes_to_float(codes: np.ndarray) -> np.ndarray:
    return _FP4_VALUES[np.asarray(codes, dtype=np.uint8) & 0xF]


def pack_fp4_codes(codes: np.ndarray) -> np.ndarray:
    """uint8 codes ``[..., n]`` (n even) -> int8 ``[..., n/2]``, even element in the low nibble."""
    c = np.asarray(codes, dtype=np.uint8)
    if c.shape[-1] % 2:
        raise ValueError(f"fp4 packing needs an even last dimension, got {c.shape}")
    b = (c[..., 0::2] & 0xF) | ((c[..., 1::2] & 0xF) << 4)
    return b.astype(np.uint8).view(np.int8)


def unpack_fp4_codes(packed: np.ndarray) -> np.ndarray:
    """int8/uint8 ``[..., m]`` -> uint8 codes ``[..., 2m]`` (low nibble first)."""
    p = np.asarray(packed)
    if p.dtype not in (np.int8, np.uint8):
        raise ValueError(f"packed fp4 must be int8 or uint8, got {p.dtype}")
    u = p.view(np.uint8)
    out = np.empty(u.shape[:-1] + (2 * u.shape[-1],), dtype=np.uint8)
    out[..., 0::2] = u & 0xF
    out[..., 1::2] = u >> 4
    return out


def quantize_fp4(w: np.ndarray, block: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """float ``[out, in]`` -> (packed int8 ``[out, in/2]``, ue8m0 uint8 ``[out, ceil(in/block)]``)."""
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"quantize_fp4 needs a 2-D array, got shape {w.shape}")
    o, i = w.shape
    if i % 2:
        raise ValueError(f"quantize_fp4 needs an even number of columns, got {i}")
    wp = _pad2(w, 1, block)
    blk = wp.reshape(o, -1, block)
    s = pow2_scale(np.abs(blk).max(axis=2), FP4_MAX)  # [o, nb]
    codes = fp4_codes(blk / s[:, :, None]).reshape(o, -1)[:, :i]
    return pack_fp4_codes(codes), float_to_e8m0(s)


def dequantize_fp4(packed: np.ndarray, scale: np.ndarray, block: int = 32) -> np.ndarray:
    """(packed int8 ``[out, in/2]``, ue8m0 ``[out, ceil(in/block)]``) -> float32 ``[out, in]``."""
    vals = fp4_codes_to_float(unpack_fp4_codes(packed))
    o, i = vals.shape
    scale = np.asarray(scale)
    if scale.shape != (o, -(-i // block)):
        raise ValueError(f"fp4 scale shape {scale.shape} does not fit weight [{o}, {i}] with blocks of {block}")
    s = np.repeat(e8m0_to_float(scale), block, axis=1)[:, :i]
    return (vals * s).astype(np.float32)
