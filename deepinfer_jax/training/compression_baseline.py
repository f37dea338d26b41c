"""Bits per byte of standard compressors on a byte string: the baselines a trained language
model's held-out bits per byte is judged against (8 * compressed size / raw size, container
headers included). gzip: Python's ``gzip.compress`` at ``compresslevel=9`` (``mtime=0``, so the
output is reproducible). xz: ``lzma.compress`` in ``FORMAT_XZ`` at ``preset=9 | PRESET_EXTREME``
(default CRC64 check)."""

from __future__ import annotations

import gzip
import lzma

GZIP_SETTINGS = "gzip.compress(compresslevel=9, mtime=0)"
XZ_SETTINGS = "lzma.compress(format=FORMAT_XZ, preset=9 | PRESET_EXTREME)"


def gzip_size(data: bytes) -> int:
    return len(gzip.compress(data, compresslevel=9, mtime=0))


def xz_size(data: bytes) -> int:
    return len(lzma.compress(data, format=lzma.FORMAT_XZ, preset=9 | lzma.PRESET_EXTREME))


def compression_bpb(data: bytes) -> dict:
    """``{"bytes", "gzip_bytes", "gzip_bpb", "xz_bytes", "xz_bpb", "settings"}`` of ``data``."""
    if not data:
        raise ValueError("compression_bpb: data is empty (0 bytes)")
    g, x = gzip_size(data), xz_size(data)
    return {"bytes": len(data), "gzip_bytes": g, "gzip_bpb": 8.0 * g / len(data),
            "xz_bytes": x, "xz_bpb": 8.0 * x / len(data),
            "settings": {"gzip": GZIP_SETTINGS, "xz": XZ_SETTINGS}}
