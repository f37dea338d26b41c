"""Refuse non-finite weights at load: a NaN or Inf in any float tensor (or a ue8m0 scale byte
0xFF, which is NaN) would load silently and turn every logit into NaN.

One pass per tensor over its raw bits, in fixed-size chunks (no copy of the tensor): an element is
non-finite iff ``bits & mask == mask`` (all exponent bits set; fp8 e4m3fn has no Inf, its NaN is
``S.1111.111``; fp4 e2m1 codes have neither).
"""

from __future__ import annotations

import numpy as np

# file dtype -> (unsigned view, mask): non-finite iff (bits & mask) == mask
_NONFINITE_BITS = {
    "BF16": (np.uint16, 0x7F80),
    "F16": (np.uint16, 0x7C00),
    "F32": (np.uint32, 0x7F800000),
    "F64": (np.uint64, 0x7FF0000000000000),
    "F8_E4M3": (np.uint8, 0x7F),
    "F8_E5M2": (np.uint8, 0x7C),
    "F8_E8M0": (np.uint8, 0xFF),
}
CHUNK = 1 << 22  # elements per chunk: bounds the scratch memory (a few MiB)


def nonfinite(arr: np.ndarray, file_dtype: str) -> tuple[int, int]:
    """(count, first flat index) of the non-finite elements of ``arr`` (file dtype ``file_dtype``);
    ``(0, -1)`` when all are finite or the dtype has no non-finite values."""
    if file_dtype not in _NONFINITE_BITS or arr.size == 0:
        return 0, -1
    view, mask = _NONFINITE_BITS[file_dtype]
    bits = np.ascontiguousarray(arr).reshape(-1).view(view)
    mask = view(mask)
    scratch = np.empty(min(CHUNK, bits.size), view)
    count, first = 0, -1
    for lo in range(0, bits.size, CHUNK):
        c = bits[lo:lo + CHUNK]
        s = scratch[:c.size]
        np.bitwise_and(c, mask, out=s)
        hit = s == mask
        n = int(np.count_nonzero(hit))
        if n and first < 0:
            first = lo + int(np.argmax(hit))
        count += n
    return count, first


def check_finite(name: str, arr: np.ndarray, file_dtype: str) -> None:
    """Raise ``ValueError`` naming tensor ``name`` if it holds a NaN or Inf."""
    count, first = nonfinite(arr, file_dtype)
    if count:
        where = np.unravel_index(first, arr.shape)
        raise ValueError(f"tensor {name} ({file_dtype} {list(arr.shape)}): {count} non-finite value(s) "
                         f"(NaN/Inf), first at index {tuple(int(i) for i in where)}")
