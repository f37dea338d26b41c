"""The last step of the Engram n-gram hash on device (JAX, 32-bit integer arithmetic only).

Why: with async scheduling the token a decode step consumes was sampled by the previous jitted
step and is still on device, while every earlier token of the request is known on the host. The
Engram row ids of that position depend on the unknown token only through the shift-0 term, so
the hash is split in two (see ``engram_hash.py`` for the full definition):

For position p with compressed ids ``t_k = c[p-k]`` (pad id where ``p-k < 0``) and
``x_k = t_k * mult[layer, k]`` (int64, exact: ``t * mult < 2**63``), the hash of n-gram size
``n = i+1`` (i = 1..K-1, K = ``max_ngram_size``) and head h is
``(x_0 ^ x_1 ^ ... ^ x_i) mod primes[layer, i-1, h] + offsets[layer, (i-1)*H + h]``.

* **Host** (:func:`host_partials`, numpy int64): the partial XORs ``P_i = x_1 ^ ... ^ x_i``,
  which need only the tokens *before* p. They are shipped as uint32 (hi, lo) word pairs,
  uint32 ``[n, n_layers, K-1, 2]``, since JAX runs in 32-bit mode here.
* **Device** (:func:`device_hash`, jittable): ``c = token_map[tok]``; ``x_0 = c * mult0`` as an
  exact 64-bit product in (hi, lo) uint32 words built from 16-bit limbs (:func:`mul_u32_u64`);
  ``x_0 ^ P_i``; the exact 64-bit value modulo each prime by Horner over ``b``-bit chunks from
  the top, ``r = ((r << b) | chunk) % p`` (:func:`mod_u64`), which stays within uint32 because
  ``r < p < 2**(32-b)``; plus the row offsets. Result int32 ``[T, n_layers, (K-1)*H]``, the
  same layout as :meth:`EngramHasher.hash_positions`.

The constants live in :class:`DeviceEngramTables` (a pytree: numpy leaves after
:meth:`DeviceEngramTables.from_hasher`, move them once with ``jax.device_put(tables)``; the chunk
width ``chunk_bits`` is static). Typical decode use::

    tables = jax.device_put(DeviceEngramTables.from_hasher(hasher))
    partials_TLK2 = np.concatenate([host_partials(hasher, hist, len(hist)) for hist in histories])
    ids_TLC = jax.jit(device_hash)(tables, sampled_tok_T, partials_TLK2)

Dead tokens (``live`` in ``hash_positions``) are not supported: every history token counts.
"""

from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.runner.engram_hash import EngramHasher

__all__ = [
    "DeviceEngramTables",
    "host_partials",
    "window_partials",
    "device_hash",
    "device_hash_window",
    "mul_u32_u64",
    "mod_u64",
    "split_u64",
]

_INT64_MAX = int(np.iinfo(np.int64).max)
_INT32_MAX = int(np.iinfo(np.int32).max)
_MASK16 = 0xFFFF


# --------------------------------------------------------------------------- host side


def split_u64(values: np.ndarray) -> np.ndarray:
    """Nonnegative int64 values -> uint32 (hi, lo) words, shape ``values.shape + (2,)``."""
    u = np.array(values, dtype=np.int64, copy=None, order="C").view(np.uint64)
    if _LITTLE_ENDIAN:  # the value with its halves swapped holds (hi, lo) in memory order
        f = u.reshape(-1)
        return ((f << np.uint64(32)) | (f >> np.uint64(32))).view(np.uint32).reshape(u.shape + (2,))
    return np.stack([(u >> np.uint64(32)).astype(np.uint32), (u & np.uint64(0xFFFFFFFF)).astype(np.uint32)], axis=-1)


_LITTLE_ENDIAN = sys.byteorder == "little"


def host_partials(
    hasher: EngramHasher, token_ids_history: np.ndarray, position: int | np.ndarray
) -> np.ndarray:
    """Partial XORs ``P_i = x_1 ^ ... ^ x_i`` (i = 1..K-1) for positions whose own token is unknown.

    token_ids_history: int [N], token ids of positions 0..N-1 (at least up to p-1).
    position: int or int [n], each p in [0, N]; the token at p itself is never read.
    Returns uint32 [n, n_layers, K-1, 2] ((hi, lo) words); n = 1 for a scalar position.
    """
    hist_N = np.asarray(token_ids_history)
    pos_n = np.atleast_1d(np.asarray(position))
    if hist_N.ndim != 1:
        raise ValueError(f"token_ids_history must be 1-D, got shape {hist_N.shape}")
    if pos_n.ndim != 1:
        raise ValueError(f"position must be a scalar or 1-D, got shape {pos_n.shape}")
    if not np.issubdtype(pos_n.dtype, np.integer):
        raise ValueError(f"position must be integer, got dtype {pos_n.dtype}")
    n_tok = hist_N.shape[0]
    vocab = hasher.token_map.shape[0]
    if hist_N.size and (hist_N.min() < 0 or hist_N.max() >= vocab):
        raise ValueError(
            f"token_ids_history must lie in [0, {vocab}), got range "
            f"[{int(hist_N.min())}, {int(hist_N.max())}]"
        )
    pos_n = pos_n.astype(np.int64)
    if pos_n.size and (pos_n.min() < 0 or pos_n.max() > n_tok):
        raise ValueError(
            f"position must lie in [0, {n_tok}] (history length {n_tok}), got range "
            f"[{int(pos_n.min())}, {int(pos_n.max())}]"
        )

    K = hasher.max_ngram_size
    # Compressed ids with the pad id appended at index N: look-backs before 0 read the pad.
    comp_N1 = np.append(hasher.token_map[hist_N.astype(np.int64)], np.int64(hasher.pad_id))
    src_nK1 = pos_n[:, None] - np.arange(1, K, dtype=np.int64)[None, :]  # shifts 1..K-1
    src_nK1 = np.where(src_nK1 >= 0, src_nK1, n_tok)
    return _partials_compressed(hasher, comp_N1[src_nK1])


def window_partials(hasher: EngramHasher, window_nK: np.ndarray) -> np.ndarray:
    """:func:`host_partials` from look-back windows, many positions in one call: ``window_nK[i, k]``
    is the token id at ``p_i - k`` or -1 before position 0 (column 0, the unknown token, is
    ignored). Returns uint32 ``[n, n_layers, K-1, 2]``."""
    return _partials_compressed(hasher, hasher.compress_windows(window_nK)[:, 1:])


def _partials_compressed(hasher: EngramHasher, t_nK1: np.ndarray) -> np.ndarray:
    # [n, L, K-1]; no overflow: t < compressed size, multiplier < int64_max // compressed size.
    partial_nLK1 = t_nK1[:, None, :] * hasher.multipliers[None, :, 1:]
    for k in range(1, partial_nLK1.shape[2]):  # the running XOR over shifts, in place (K-1 is small)
        partial_nLK1[:, :, k] ^= partial_nLK1[:, :, k - 1]
    return split_u64(partial_nLK1)


# --------------------------------------------------------------------------- tables


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class DeviceEngramTables:
    """Engram hash constants in 32-bit form (pytree; ``chunk_bits`` is static).

    Build with :meth:`from_hasher`; the leaves are numpy arrays until moved with
    ``jax.device_put``. ``eq=False``: instances compare by identity (array fields).
    """

    token_map_V: jax.Array | np.ndarray  # int32 [vocab], compressed id of each token id
    mult0_L2: jax.Array | np.ndarray  # uint32 [n_layers, 2], (hi, lo) of multipliers[:, 0]
    primes_LGH: jax.Array | np.ndarray  # uint32 [n_layers, K-1, n_heads]
    offsets_LC: jax.Array | np.ndarray  # int32 [n_layers, (K-1)*n_heads]
    chunk_bits: int = dataclasses.field(metadata=dict(static=True))  # Horner chunk width b
    # every shift's multiplier (device_hash_window: all of a position's tokens on device)
    mult_LK2: jax.Array | np.ndarray | None = None  # uint32 [n_layers, K, 2]
    pad_id: int = dataclasses.field(default=0, metadata=dict(static=True))  # compressed id before position 0

    @classmethod
    def from_hasher(cls, hasher: EngramHasher) -> "DeviceEngramTables":
        """Convert ``hasher``'s constants; ValueError if they do not fit the 32-bit device math."""
        token_map = np.asarray(hasher.token_map, dtype=np.int64)
        mult = np.asarray(hasher.multipliers, dtype=np.int64)
        primes = np.asarray(hasher.primes, dtype=np.int64)
        offsets = np.asarray(hasher.offsets, dtype=np.int64)

        cmax = int(token_map.max())
        if int(token_map.min()) < 0 or cmax > _INT32_MAX:
            raise ValueError(
                f"Engram token_map entries must lie in [0, 2**31) for the int32 device map, got "
                f"range [{int(token_map.min())}, {cmax}]"
            )
        if int(mult.min()) < 1:
            raise ValueError(f"Engram multipliers must be positive, got min {int(mult.min())}")
        mmax = int(mult.max())
        cpad = max(cmax, int(hasher.pad_id))
        if cpad * mmax > _INT64_MAX:
            raise ValueError(
                f"Engram hash product overflows int64: max compressed id {cpad} * max "
                f"multiplier {mmax} > 2**63 - 1"
            )
        pmin, pmax = int(primes.min()), int(primes.max())
        if pmin < 2:
            raise ValueError(f"Engram primes must be >= 2, got {pmin}")
        chunk_bits = 32 - pmax.bit_length()
        if chunk_bits < 1:
            raise ValueError(
                f"Engram prime {pmax} is too large for the uint32 device modular reduction: "
                f"primes must be < 2**31 (the Horner chunk width 32 - bit_length(prime) must "
                f"be >= 1)"
            )
        n_layers = primes.shape[0]
        rows_end = offsets + primes.reshape(n_layers, -1)
        if int(rows_end.max()) > _INT32_MAX + 1 or int(offsets.min()) < 0:
            raise ValueError(
                f"Engram table row ids must fit int32: offsets + primes reach "
                f"{int(rows_end.max())} rows (limit 2**31)"
            )
        return cls(
            token_map_V=token_map.astype(np.int32),
            mult0_L2=split_u64(mult[:, 0]),
            primes_LGH=primes.astype(np.uint32),
            offsets_LC=offsets.astype(np.int32),
            chunk_bits=int(chunk_bits),
            mult_LK2=split_u64(mult),
            pad_id=int(hasher.pad_id),
        )


# --------------------------------------------------------------------------- device math


def _mul_u32_wide(a, b):
    """Exact 32x32 -> 64-bit product of uint32 arrays as (hi, lo) uint32 words (16-bit limbs)."""
    a0, a1 = a & _MASK16, a >> 16
    b0, b1 = b & _MASK16, b >> 16
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1  # each < 2**32
    mid = (p00 >> 16) + (p01 & _MASK16) + (p10 & _MASK16)  # < 3 * 2**16
    lo = (mid << 16) | (p00 & _MASK16)
    hi = p11 + (p01 >> 16) + (p10 >> 16) + (mid >> 16)  # true value < 2**32: no wrap
    return hi, lo


def mul_u32_u64(a, b_hi, b_lo):
    """``a * (b_hi:b_lo) mod 2**64`` for uint32 arrays (broadcasting), as (hi, lo) uint32 words."""
    a = jnp.asarray(a, jnp.uint32)
    hi, lo = _mul_u32_wide(a, jnp.asarray(b_lo, jnp.uint32))
    return hi + a * jnp.asarray(b_hi, jnp.uint32), lo  # uint32 multiply wraps mod 2**32


def _bits(hi, lo, start: int, width: int):
    """Bits [start, start+width) of the 64-bit hi:lo (static ints, width <= 31; 0 above bit 63)."""
    mask = jnp.uint32((1 << width) - 1)
    if start >= 64:
        return jnp.zeros_like(lo)
    if start >= 32:
        return (hi >> (start - 32)) & mask
    if start + width <= 32:
        return (lo >> start) & mask
    return ((lo >> start) | (hi << (32 - start))) & mask  # straddles the two words


def mod_u64(hi, lo, prime, chunk_bits: int):
    """Exact ``(hi:lo) mod prime`` for uint32 arrays (broadcasting), result uint32.

    Horner over ``chunk_bits``-bit chunks of the 64-bit value from the top:
    ``r = ((r << b) | chunk) % prime``. Exact when ``prime < 2**(32 - chunk_bits)``, since then
    ``r < prime`` keeps ``r << b | chunk`` below 2**32. ``chunk_bits`` must be static.
    """
    b = int(chunk_bits)
    if not 1 <= b <= 31:
        raise ValueError(f"chunk_bits must be in [1, 31], got {b}")
    hi = jnp.asarray(hi, jnp.uint32)
    lo = jnp.asarray(lo, jnp.uint32)
    prime = jnp.asarray(prime, jnp.uint32)
    n_chunks = -(-64 // b)
    r = None
    for j in range(n_chunks - 1, -1, -1):  # chunk j holds bits [j*b, (j+1)*b)
        chunk = _bits(hi, lo, j * b, b)
        r = chunk % prime if r is None else ((r << b) | chunk) % prime
    return r


def device_hash(tables: DeviceEngramTables, token_ids_T, partials_TLK2) -> jax.Array:
    """Engram row ids of T positions whose own token ids are only known on device.

    tables: :class:`DeviceEngramTables` (numpy or device leaves).
    token_ids_T: int [T], the token id at each position (shift 0); out-of-range ids are clamped
        by the gather, not checked.
    partials_TLK2: uint32 [T, n_layers, K-1, 2], from :func:`host_partials` of each position.
    Returns int32 [T, n_layers, (K-1)*n_heads], equal to ``EngramHasher.hash_positions``.
    Jittable; uses only 32-bit integer arithmetic.
    """
    n_layers, n_gram, n_heads = tables.primes_LGH.shape
    tok_T = jnp.asarray(token_ids_T)
    partials_TLK2 = jnp.asarray(partials_TLK2)
    if tok_T.ndim != 1:
        raise ValueError(f"token_ids_T must be 1-D, got shape {tok_T.shape}")
    T = tok_T.shape[0]
    if partials_TLK2.shape != (T, n_layers, n_gram, 2):
        raise ValueError(
            f"partials_TLK2 must have shape {(T, n_layers, n_gram, 2)}, got {partials_TLK2.shape}"
        )
    if partials_TLK2.dtype != jnp.uint32:
        raise TypeError(f"partials_TLK2 must be uint32, got {partials_TLK2.dtype}")

    token_map_V = jnp.asarray(tables.token_map_V)
    mult0_L2 = jnp.asarray(tables.mult0_L2)
    c_T = jnp.take(token_map_V, tok_T.astype(jnp.int32), mode="clip").astype(jnp.uint32)
    # x_0 = c * mult0[layer], exact 64-bit: [T, L]
    x0_hi_TL, x0_lo_TL = mul_u32_u64(c_T[:, None], mult0_L2[None, :, 0], mult0_L2[None, :, 1])
    v_hi_TLG = x0_hi_TL[:, :, None] ^ partials_TLK2[..., 0]
    v_lo_TLG = x0_lo_TL[:, :, None] ^ partials_TLK2[..., 1]
    h_TLGH = mod_u64(
        v_hi_TLG[..., None], v_lo_TLG[..., None], jnp.asarray(tables.primes_LGH)[None],
        tables.chunk_bits,
    )
    h_TLC = h_TLGH.reshape(T, n_layers, n_gram * n_heads).astype(jnp.int32)
    return h_TLC + jnp.asarray(tables.offsets_LC)[None]


def device_hash_window(tables: DeviceEngramTables, window_TK) -> jax.Array:
    """Engram row ids of T positions whose whole n-gram window is on device.

    window_TK: int [T, K]: ``window_TK[t, k]`` = the token id at position ``p_t - k`` (k = 0..K-1,
    K = ``max_ngram_size``), or -1 where ``p_t - k < 0`` (the pad id). Returns int32
    ``[T, n_layers, (K-1)*n_heads]``, equal to ``EngramHasher.hash_positions`` (tested).
    """
    if tables.mult_LK2 is None:
        raise ValueError("device_hash_window needs tables built by DeviceEngramTables.from_hasher")
    n_layers, n_gram, n_heads = tables.primes_LGH.shape
    win = jnp.asarray(window_TK, jnp.int32)
    T, K = win.shape
    if K != n_gram + 1:
        raise ValueError(f"window_TK has {K} shifts; the tables hash n-grams of up to {n_gram + 1}")
    c_TK = jnp.where(win >= 0, jnp.take(jnp.asarray(tables.token_map_V), jnp.maximum(win, 0), mode="clip"),
                     tables.pad_id).astype(jnp.uint32)
    mult = jnp.asarray(tables.mult_LK2)
    x_hi, x_lo = mul_u32_u64(c_TK[:, None, :], mult[None, :, :, 0], mult[None, :, :, 1])  # [T, L, K]
    v_hi, v_lo = x_hi[..., 0], x_lo[..., 0]
    his, los = [], []
    for i in range(1, K):  # n-gram of size i + 1: x_0 ^ ... ^ x_i
        v_hi, v_lo = v_hi ^ x_hi[..., i], v_lo ^ x_lo[..., i]
        his.append(v_hi)
        los.append(v_lo)
    v_hi_TLG, v_lo_TLG = jnp.stack(his, -1), jnp.stack(los, -1)
    h_TLGH = mod_u64(v_hi_TLG[..., None], v_lo_TLG[..., None], jnp.asarray(tables.primes_LGH)[None],
                     tables.chunk_bits)
    return h_TLGH.reshape(T, n_layers, n_gram * n_heads).astype(jnp.int32) + jnp.asarray(tables.offsets_LC)[None]
