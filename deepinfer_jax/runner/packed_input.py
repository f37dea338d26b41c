"""One host-to-device transfer per dtype for a step's input arrays.

A step's ``StepInput`` holds about thirty small numpy arrays; passed to the jitted step as they
are, each becomes its own host-to-device copy. ``pack`` concatenates the leaves of each dtype
into one flat buffer (a handful of transfers); ``unpack``, inside the jitted step, slices them
back into the original pytree. The ``PackedLayout`` (tree structure, shapes, offsets) is a
hashable static argument: every bucket has one, compiled once like the bucket itself.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class PackedLayout:
    treedef: object                                    # the pytree structure (None leaves included)
    leaves: tuple[tuple[int, int, tuple[int, ...]], ...]  # per leaf: (buffer, offset, shape)


def pack(tree) -> tuple[tuple[np.ndarray, ...], PackedLayout]:
    """Host arrays of ``tree`` -> (one flat buffer per dtype, the layout to rebuild it)."""
    leaves, treedef = jax.tree.flatten(tree)
    buffer_of: dict[str, int] = {}     # dtype -> buffer index, in order of first appearance
    parts: list[list[np.ndarray]] = []
    sizes: list[int] = []
    where = []
    for a in (np.asarray(x) for x in leaves):
        b = buffer_of.setdefault(a.dtype.str, len(parts))
        if b == len(parts):
            parts.append([])
            sizes.append(0)
        where.append((b, sizes[b], a.shape))
        parts[b].append(a.reshape(-1))
        sizes[b] += a.size
    bufs = tuple(np.concatenate(p) if len(p) > 1 else p[0].copy() for p in parts)
    return bufs, PackedLayout(treedef, tuple(where))


def unpack(bufs, layout: PackedLayout):
    """Inverse of ``pack`` (traceable: static slices of the buffers)."""
    leaves = [jax.lax.slice_in_dim(bufs[b], off, off + int(np.prod(shape, dtype=np.int64))).reshape(shape)
              for b, off, shape in layout.leaves]
    return jax.tree.unflatten(layout.treedef, leaves)
