"""Packed storage of the attention KV caches (``kv_cache_dtype="packed"``): the same values, fewer bytes.

The model rounds what it caches (``V41_MODEL.md``): every window KV entry is fp8-QDQ'd
(``quant.act_quant_fp8``: e4m3 with a power-of-two scale per 32 channels) and every compressed
KV entry is fp4-QDQ'd (``quant.act_quant_fp4(..., 16, "e4m3")``: e2m1 with an e4m3 scale per 16).
The bf16 caches hold those rounded values at 2 bytes a channel. Packed, they hold the codes:

| cache | bf16 (A = 512) | packed | layout |
|---|---|---|---|
| window ring | 1024 B / entry | 528 B | e4m3 codes ``[.., A]`` + ue8m0 scale bytes ``[.., A/32]`` |
| compressed KV | 1024 B / entry | 288 B | e2m1 codes two a byte (even channel low) ``[.., A/2]`` + e4m3 scales ``[.., A/16]`` |

Decoding is exact: an e4m3 value times a power of two, and an e2m1 value (2 significant bits)
times an e4m3 scale (4 bits), are bf16 numbers (8 bits), signs of zero included. So
``unpack_*(pack_*(x))`` is bit for bit the QDQ of ``x`` and every score and output is unchanged.

A packed pool travels to ``ops.sparse_attention`` as a ``PackedPool`` (codes, scales) whose
dtypes name the format; the attention reference gathers the selected rows of both and decodes
only those, the GPU kernel decodes in registers after its row gather.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from deepinfer_jax.base import quant

KV_CACHE_DTYPES = ("bf16", "packed")
WINDOW_BLOCK = 32   # channels per scale of a window entry (act_quant_fp8's block)
COMP_BLOCK = 16     # channels per scale of a compressed entry (act_quant_fp4's block for KV)


class PackedPool(NamedTuple):
    """Rows of packed KV entries: ``codes [N, A]`` e4m3 with ``scales [N, A/32]`` uint8 (ue8m0
    exponent bytes) — fp8 window entries — or ``codes [N, A/2]`` uint8 (two e2m1 a byte) with
    ``scales [N, A/16]`` e4m3 — fp4 compressed entries."""

    codes: jax.Array
    scales: jax.Array

    @property
    def fmt(self) -> str:
        return pool_format(self)

    @property
    def width(self) -> int:
        """A: channels of an entry once decoded."""
        return self.codes.shape[-1] * (2 if self.fmt == "fp4" else 1)


def pool_format(pool) -> str:
    """``"bf16"`` for a plain array, ``"fp8"`` / ``"fp4"`` for a ``PackedPool`` (from its dtypes)."""
    if not isinstance(pool, PackedPool):
        return "bf16"
    c, s = jnp.dtype(pool.codes.dtype), jnp.dtype(pool.scales.dtype)
    if c == jnp.float8_e4m3fn and s == jnp.uint8:
        return "fp8"
    if c == jnp.uint8 and s == jnp.float8_e4m3fn:
        return "fp4"
    raise ValueError(f"PackedPool: codes {c} with scales {s} is no packed KV format "
                     "(fp8: e4m3 codes + uint8 scales; fp4: uint8 codes + e4m3 scales)")


# ----------------------------------------------------------------------------- window entries: fp8
def pack_window(x_NA: jax.Array) -> PackedPool:
    """fp8 window entries: the codes and scale exponents of ``quant.act_quant_fp8(x_NA)``."""
    q, s = quant.act_quant_fp8_codes(x_NA, WINDOW_BLOCK)
    exps = (jax.lax.bitcast_convert_type(s, jnp.int32) >> 23).astype(jnp.uint8)
    return PackedPool(q, exps)


def unpack_window(pool: PackedPool, dtype=jnp.bfloat16) -> jax.Array:
    codes, exps = pool
    A = codes.shape[-1]
    v = codes.astype(jnp.float32).reshape(*codes.shape[:-1], A // WINDOW_BLOCK, WINDOW_BLOCK)
    return (v * quant.e8m0_to_f32(exps)[..., None]).reshape(codes.shape).astype(dtype)


# ----------------------------------------------------------------------------- compressed entries: fp4
def pack_comp(x_NA: jax.Array) -> PackedPool:
    """fp4 compressed entries: the codes and scales of ``quant.act_quant_fp4(x_NA, 16, "e4m3")``."""
    code, s = quant.act_quant_fp4_codes(x_NA, COMP_BLOCK, "e4m3")  # [..., A] 4 bits, sign in bit 3
    pairs = code.reshape(*code.shape[:-1], -1, 2)
    packed = (pairs[..., 0] | (pairs[..., 1] << 4)).astype(jnp.uint8)
    return PackedPool(packed, s.astype(jnp.float8_e4m3fn))


def unpack_comp(pool: PackedPool, dtype=jnp.bfloat16) -> jax.Array:
    packed, scales = pool
    v = quant.unpack_fp4(packed)                    # [..., A] f32 e2m1 values
    A = v.shape[-1]
    v = v.reshape(*v.shape[:-1], A // COMP_BLOCK, COMP_BLOCK) * scales.astype(jnp.float32)[..., None]
    return v.reshape(*v.shape[:-2], A).astype(dtype)


def unpack(pool, dtype=jnp.bfloat16) -> jax.Array:
    """Any pool as ``dtype`` entries (a plain array passes through)."""
    fmt = pool_format(pool)
    if fmt == "bf16":
        return pool.astype(dtype)
    return unpack_window(pool, dtype) if fmt == "fp8" else unpack_comp(pool, dtype)


def take_rows(pool, idx, dtype=jnp.bfloat16) -> jax.Array:
    """``unpack(pool)[idx]`` decoding only the rows taken (``idx`` any int shape, in range)."""
    if pool_format(pool) == "bf16":
        return jnp.take(pool, idx, axis=0).astype(dtype)
    return unpack(PackedPool(*(jnp.take(a, idx, axis=0) for a in pool)), dtype)
