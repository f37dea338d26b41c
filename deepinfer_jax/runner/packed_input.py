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
    leaves = [x if type(x) is np.ndarray else np.asarray(x) for x in leaves]
    key = (treedef, tuple([(a.dtype, a.shape) for a in leaves]))
    plan = _plans.get(key)
    if plan is None:  # a new bucket / layout: which leaves go to which buffer
        if len(_plans) >= 4096:  # (a bound; an engine has a few dozen layouts)
            _plans.clear()
        plan = _plans[key] = _plan(leaves, treedef)
    groups, layout = plan
    return tuple([np.concatenate([leaves[i] for i in g], axis=None) for g in groups]), layout


def _plan(leaves, treedef) -> tuple[tuple[tuple[int, ...], ...], PackedLayout]:
    """(the leaf indices of each buffer, the layout) of leaves of these dtypes and shapes."""
    buffer_of: dict[str, int] = {}     # dtype -> buffer index, in order of first appearance
    groups: list[list[int]] = []
    sizes: list[int] = []
    where = []
    for i, a in enumerate(leaves):
        b = buffer_of.setdefault(a.dtype.str, len(groups))
        if b == len(groups):
            groups.append([])
            sizes.append(0)
        where.append((b, sizes[b], a.shape))
        groups[b].append(i)
        sizes[b] += a.size
    return tuple(tuple(g) for g in groups), PackedLayout(treedef, tuple(where))


# (treedef, leaves' dtypes and shapes) -> _plan: one per bucket and input kind
_plans: dict = {}


def unpack(bufs, layout: PackedLayout):
    """Inverse of ``pack`` (traceable: static slices of the buffers)."""
    leaves = [jax.lax.slice_in_dim(bufs[b], off, off + int(np.prod(shape, dtype=np.int64))).reshape(shape)
              for b, off, shape in layout.leaves]
    return jax.tree.unflatten(layout.treedef, leaves)
