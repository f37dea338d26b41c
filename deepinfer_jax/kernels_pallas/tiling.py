"""Generation-independent tiling helpers for the grouped (per-expert) matmul kernels.

What lives here is plain arithmetic that any tensor-core generation shares: the *aligned group
layout* (every expert's rows padded up to a multiple of ``block_m``, so that each row tile
belongs to exactly one expert and a kernel never has to mask rows or store a ragged tile),
block-size pickers that only look at divisibility and at an on-chip-memory budget, and the
decode/prefill regime split. Numbers that depend on the chip (MMA shapes, shared-memory size,
pipeline depth) are passed in by the per-generation code (``moe_gmm.py``: ``hopper_tiling``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return cdiv(a, b) * b


@dataclasses.dataclass(frozen=True)
class GmmTiling:
    """Block sizes of one grouped-matmul launch.

    ``block_m``: rows (tokens) per tile, also the group alignment; ``block_n``: output columns
    per tile; ``block_k``: contraction elements per pipeline step; ``stages``: pipeline depth
    (tiles in flight in shared memory); ``grid_tile_width``: how many output-column tiles a
    wave of CTAs sweeps together before moving on to the next rows (L2 locality);
    ``k_splits``: the contraction is cut into this many equal slices, each its own work item
    writing fp32 partial sums that a second (fused, fixed-order) pass adds up: more work items
    than (row tile x column tile) alone when those fill the processors' waves badly (decode);
    ``ctas_per_sm``: persistent CTAs launched per processor (each with its share of the on-chip
    memory): two let one CTA's in-register work (weight dequantization) run while the other's
    waits on memory or the tensor core; ``fp8_mma``: fp8 weights and fp8-quantized activations
    go to the tensor core as e4m3 codes with per-32 scale promotion (``moe_gmm_fp8mma.py``)
    instead of the weights being dequantized to bf16 first.
    """

    block_m: int
    block_n: int
    block_k: int
    stages: int
    grid_tile_width: int = 1
    k_splits: int = 1
    ctas_per_sm: int = 1
    fp8_mma: bool = False

    def __post_init__(self):
        for f in ("block_m", "block_n", "block_k", "stages", "grid_tile_width", "k_splits", "ctas_per_sm"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"GmmTiling.{f}={v!r}: must be a positive integer")


# ----------------------------------------------------------------------------- regime / blocks
def rows_per_group(m_rows: int, n_groups: int) -> float:
    """Average routed rows per expert: the number that separates decode from prefill."""
    return m_rows / max(n_groups, 1)


def pick_block_m(m_rows: int, n_groups: int, mma_m: int, candidates: Sequence[int]) -> int:
    """Smallest candidate (a multiple of the MMA's row granularity ``mma_m``) that holds an
    average group, capped by the largest candidate.

    Rows of a tile beyond its group are padding that the tensor core multiplies anyway; at
    decode (a few rows per expert) the smallest tile wastes the least, while at prefill a
    larger tile reads each weight tile fewer times (weight re-reads scale with M / block_m).
    """
    cands = sorted(c for c in candidates if c % mma_m == 0)
    if not cands:
        raise ValueError(f"no block_m candidate in {candidates} is a multiple of {mma_m}")
    avg = rows_per_group(m_rows, n_groups)
    for c in cands:
        if avg <= c:
            return c
    return cands[-1]


def pick_block(dim: int, candidates: Sequence[int]) -> int:
    """Largest candidate dividing ``dim`` (the kernels do not mask the N and K edges)."""
    for c in sorted(candidates, reverse=True):
        if dim % c == 0:
            return c
    raise ValueError(f"dimension {dim} is not a multiple of any block size in {tuple(candidates)}")


def expected_active_tiles(m_rows: int, n_groups: int, block_m: int) -> int:
    """Row tiles in use, expected when each of ``m_rows`` rows picks one of ``n_groups`` groups
    uniformly (group sizes ~ Binomial(M, 1/E), normal approximation): ``E * sum_j P(g > j*bm)``.
    Imbalance matters at decode: 512 rows over 8 experts average 64 a group, one 64-row tile
    each on paper, but about half the groups get more than 64 and a second tile (~12 tiles, not
    8). Capped by the static bound ``num_tiles_bound`` that the grid is sized for."""
    if m_rows <= 0:
        return 1
    p = 1.0 / max(n_groups, 1)
    mu = m_rows * p
    sd = max(math.sqrt(m_rows * p * (1 - p)), 1e-9)
    per_group, j = 0.0, 0
    while j * block_m < m_rows:
        tail = 0.5 * math.erfc((j * block_m + 0.5 - mu) / (sd * math.sqrt(2)))  # P(g > j*bm)
        per_group += tail
        if tail < 1e-4 and j * block_m > mu:
            break
        j += 1
    est = max(1, round(n_groups * per_group))
    return min(est, num_tiles_bound(m_rows, n_groups, block_m))


def wave_efficiency(n_items: int, n_workers: int) -> float:
    """Fraction of the workers' time spent on work when ``n_items`` equal items are dealt
    round-robin to ``n_workers`` (the last wave may be partial)."""
    return n_items / (cdiv(n_items, n_workers) * n_workers)


def pick_block_n(n_out: int, candidates: Sequence[int], row_tiles: int, n_workers: int,
                 min_efficiency: float = 0.8) -> int:
    """Largest candidate dividing ``n_out`` whose (row tile, column tile) work items fill the
    processors' waves to at least ``min_efficiency``; else the best-filling one. Matters at
    decode, where a few row tiles times ``n_out / block_n`` is about one or two waves."""
    fits = [c for c in sorted(candidates, reverse=True) if n_out % c == 0]
    if not fits:
        raise ValueError(f"dimension {n_out} is not a multiple of any block size in {tuple(candidates)}")
    eff = {c: wave_efficiency(row_tiles * (n_out // c), n_workers) for c in fits}
    for c in fits:
        if eff[c] >= min_efficiency:
            return c
    return max(fits, key=lambda c: (eff[c], c))


def divisors(n: int, at_most: int) -> tuple[int, ...]:
    """Divisors of ``n`` in ``[1, at_most]``, ascending."""
    return tuple(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


def pick_stages(bytes_per_stage: int, fixed_bytes: int, budget_bytes: int, lo: int, hi: int) -> int:
    """Deepest pipeline (in ``[lo, hi]``) whose stage buffers fit the on-chip budget."""
    s = (budget_bytes - fixed_bytes) // max(bytes_per_stage, 1)
    if s < lo:
        raise ValueError(
            f"tiles need {fixed_bytes + lo * bytes_per_stage} bytes of shared memory at the minimum "
            f"depth {lo}; budget is {budget_bytes}")
    return int(min(s, hi))


# ----------------------------------------------------------------------------- aligned layout
def num_tiles_bound(m_rows: int, n_groups: int, block_m: int) -> int:
    """Static upper bound on row tiles once each group is padded to ``block_m``:
    ``sum_e ceil(g_e / bm) <= cdiv(sum_e g_e, bm) + E - 1`` for ``sum_e g_e <= M``."""
    return max(cdiv(max(m_rows, 1), block_m) + n_groups - 1, 1)


@dataclasses.dataclass(frozen=True)
class AlignedLayout:
    """Where each group's rows sit once every group starts at a multiple of ``block_m``.

    ``tile_group[t]``: the group owning row tile ``t`` (``-1``: unused tile past the end);
    ``group_start[e]``: first row of group ``e`` in the unpadded (sorted) order;
    ``padded_start[e]``: first row of group ``e`` in the padded order (a multiple of block_m);
    ``n_tiles`` / ``block_m``: static sizes; the padded arrays have ``n_tiles * block_m`` rows.
    """

    tile_group: jax.Array
    group_start: jax.Array
    padded_start: jax.Array
    group_sizes: jax.Array
    n_tiles: int
    block_m: int

    @property
    def padded_rows(self) -> int:
        return self.n_tiles * self.block_m

    def padded_row_source(self) -> tuple[jax.Array, jax.Array]:
        """For each padded row: (row in the unpadded order, is it a real row)."""
        p = jnp.arange(self.padded_rows, dtype=jnp.int32)
        g = self.tile_group[p // self.block_m]
        gc = jnp.maximum(g, 0)
        local = p - self.padded_start[gc]
        valid = (g >= 0) & (local < self.group_sizes[gc])
        src = jnp.where(valid, self.group_start[gc] + local, 0)
        return src, valid

    def padded_position(self, row: jax.Array, group: jax.Array) -> jax.Array:
        """Padded position of unpadded row ``row`` that belongs to ``group`` (0 if group < 0)."""
        gc = jnp.maximum(group, 0)
        return jnp.where(group >= 0, self.padded_start[gc] + row - self.group_start[gc], 0)


def count_at_most(sorted_E: jax.Array, v: jax.Array) -> jax.Array:
    """``searchsorted(sorted_E, v, side="right")`` for a short sorted ``[E]`` (int32): the count
    of entries <= each ``v``, as one compare-and-sum fusion. ``jnp.searchsorted``'s default
    lowers to an XLA while loop (a binary search of log2(E) iterations), and a while loop on the
    GPU costs ~22 us an iteration (the mHC Sinkhorn loop, measured on an H200: see sinkhorn.py)."""
    return jnp.sum(sorted_E[None, :] <= v.reshape(-1)[:, None], axis=1, dtype=jnp.int32).reshape(v.shape)


def aligned_layout(group_sizes: jax.Array, m_rows: int, block_m: int) -> AlignedLayout:
    """Build the aligned layout of ``group_sizes`` (int32 ``[E]``, sum <= ``m_rows``)."""
    gs = group_sizes.astype(jnp.int32)
    n_groups = gs.shape[0]
    n_tiles = num_tiles_bound(m_rows, n_groups, block_m)
    tiles_per_group = (gs + block_m - 1) // block_m
    tile_end = jnp.cumsum(tiles_per_group)
    tile_begin = tile_end - tiles_per_group
    t = jnp.arange(n_tiles, dtype=jnp.int32)
    # group of tile t = number of groups whose tiles end at or before t (empty groups own none)
    owner = count_at_most(tile_end, t)
    tile_group = jnp.where(t < tile_end[-1], owner, -1).astype(jnp.int32)
    group_start = (jnp.cumsum(gs) - gs).astype(jnp.int32)
    return AlignedLayout(tile_group=tile_group, group_start=group_start,
                         padded_start=(tile_begin * block_m).astype(jnp.int32), group_sizes=gs,
                         n_tiles=n_tiles, block_m=block_m)


def group_of_row(group_sizes: jax.Array, m_rows: int) -> jax.Array:
    """Group id of each of ``m_rows`` sorted rows (``-1`` past ``sum(group_sizes)``)."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    r = jnp.arange(m_rows, dtype=jnp.int32)
    g = count_at_most(ends, r)
    return jnp.where(r < ends[-1], g, -1)


# ----------------------------------------------------------------------------- sparse attention
# Gathered-KV attention (sparse_attention.py): the walk over blocks of the concatenated index
# lists and the heads-per-program choice. Chip numbers (SM count, shared memory) come from the
# per-generation code in sparse_attention.py.
@dataclasses.dataclass(frozen=True)
class Segment:
    """Blocks ``[b0, b1)`` of the concatenated index lists. ``parts``: per touched pool
    ``(pool, lo, hi)``, the positions ``[lo, hi)`` inside each block that belong to it (a run of
    blocks lying inside one pool has one part ``(pool, 0, block)``; a block straddling pools has
    one part per pool and ``b1 == b0 + 1``)."""

    b0: int
    b1: int
    parts: tuple[tuple[int, int, int], ...]


def block_plan(widths: Sequence[int], block: int) -> tuple[Segment, ...]:
    """Static walk over the blocks of the concatenated index lists of ``widths`` entries each
    (padded with -1 to a multiple of ``block``; the padding belongs to the last non-empty list)."""
    total = sum(widths)
    nb = cdiv(total, block)
    nonempty = [i for i, w in enumerate(widths) if w > 0]
    start, ranges = 0, []
    for i, w in enumerate(widths):
        if w > 0:
            ranges.append((i, start, nb * block if i == nonempty[-1] else start + w))
        start += w
    segs: list[Segment] = []
    for b in range(nb):
        lo_b, hi_b = b * block, (b + 1) * block
        parts = tuple((i, max(lo, lo_b) - lo_b, min(hi, hi_b) - lo_b)
                      for i, lo, hi in ranges if lo < hi_b and hi > lo_b)
        if len(parts) == 1 and segs and segs[-1].parts == parts:
            segs[-1] = Segment(segs[-1].b0, b + 1, parts)
        else:
            segs.append(Segment(b, b + 1, parts))
    return tuple(segs)


def pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def pick_heads_per_program(n_heads: int, n_tokens: int, n_workers: int, lo: int = 16,
                           hi: int = 64) -> int:
    """Heads per program (a power of two in ``[lo, hi]``, the MMA M dimension): ``hi`` unless
    that leaves most processors idle on a small batch; halved while the programs at the halved
    size still fit one wave (each extra program re-reads the same rows, from L2)."""
    bh = max(lo, min(hi, pow2_at_least(n_heads)))
    while bh > lo and 2 * n_tokens * cdiv(n_heads, bh) <= n_workers:
        bh //= 2
    return bh
