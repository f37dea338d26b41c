"""Logical axis names of parameters -> mesh axes -> ``NamedSharding``s.

Parameters carry their logical axes in the NNX metadata key ``logical_axes`` (one name or
``None`` per dim). ``LOGICAL_RULES`` maps a name to a tuple of mesh axes (that dim is split over
their product) or ``None`` (replicated). Names not in the table are replicated.

* ``"expert"``  -> ``("dp", "cp")``: routed experts spread over the whole expert-parallel group
  (ep = flattened dp x cp).
* ``"table_rows"`` -> ``("dp", "cp")``: Engram tables are the largest tensors of the model
  (hundreds of millions of rows); their rows are split over every device.
* ``"vocab"`` -> replicated for now: the embedding / LM head / Markov head are small next to the
  experts and the Engram tables, and splitting the vocab needs a sharded argmax/sampler and a
  gathered embedding lookup in the step; until the sampler is vocab-parallel, keeping them whole
  on each device avoids an all-gather of the logits every step.
* ``"heads"`` -> replicated: attention runs data-parallel (different requests per dp shard), so
  attention weights (including ``attn_sink``) are whole on every device.

Divisibility: a dim whose size is not divisible by its mesh-axes product falls back to the
largest sub-group of those axes that divides it (e.g. 4 DSpark experts on dp=4 x cp=2 are split
over ``dp`` only, replicated over ``cp``), and to replicated when none does. Every fallback is
logged (``logging`` logger ``deepinfer_jax.sharding.partition``).
"""

from __future__ import annotations

import itertools
import logging
import math
from typing import Any, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

log = logging.getLogger(__name__)

LOGICAL_RULES: dict[str, tuple[str, ...] | None] = {
    "expert": ("dp", "cp"),
    "table_rows": ("dp", "cp"),
    "vocab": None,
    "heads": None,
}


def _axes_size(mesh: Mesh, axes: Sequence[str]) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def _fit(axes: tuple[str, ...], mesh: Mesh, size: int) -> tuple[str, ...]:
    """The largest (by device count) order-preserving subset of ``axes`` whose product divides
    ``size``; ``()`` when none does."""
    best: tuple[str, ...] = ()
    best_n = 1
    for k in range(len(axes), 0, -1):
        for sub in itertools.combinations(axes, k):
            n = _axes_size(mesh, sub)
            if size % n == 0 and n > best_n:
                best, best_n = sub, n
    return best


def logical_to_spec(axes: Sequence[str | None] | None, mesh: Mesh, shape: Sequence[int] | None = None,
                    rules: dict[str, tuple[str, ...] | None] | None = None) -> PartitionSpec:
    """``PartitionSpec`` for a parameter with logical ``axes`` on ``mesh``.

    With ``shape``, a dim not divisible by its mesh axes falls back to the largest dividing
    sub-group of them, else replicated (logged). Mesh axes of size 1 are kept out of the spec,
    as is any mesh axis already used by an earlier dim."""
    rules = LOGICAL_RULES if rules is None else rules
    if axes is None:
        return PartitionSpec()
    axes = tuple(axes)
    if shape is not None and len(shape) != len(axes):
        raise ValueError(f"logical axes {axes} do not match shape {tuple(shape)}")
    used: set[str] = set()
    spec = []
    for d, name in enumerate(axes):
        mesh_axes = rules.get(name) if name is not None else None
        if mesh_axes is None:
            spec.append(None)
            continue
        if isinstance(mesh_axes, str):
            mesh_axes = (mesh_axes,)
        want = tuple(a for a in mesh_axes if a in mesh.shape and mesh.shape[a] > 1 and a not in used)
        got = want
        if shape is not None and want and shape[d] % _axes_size(mesh, want):
            got = _fit(want, mesh, shape[d])
            log.debug("dim %d (%r) of size %d does not divide over mesh axes %s (%d devices): %s",
                      d, name, shape[d], want, _axes_size(mesh, want),
                      f"split over {got}" if got else "replicated")
        used.update(got)
        spec.append(None if not got else (got[0] if len(got) == 1 else got))
    while spec and spec[-1] is None:
        spec.pop()
    return PartitionSpec(*spec)


def split_axes(name: str, mesh, size: int) -> tuple[str, ...]:
    """The mesh axes a dim of logical axis ``name`` and ``size`` is split over on ``mesh`` (as
    ``logical_to_spec`` places it), in order; ``()`` when it is replicated."""
    spec = logical_to_spec((name,), mesh, (size,))
    axes = spec[0] if len(spec) else None
    if axes is None:
        return ()
    return tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)


def _logical_axes(var) -> tuple | None:
    try:
        md = var.get_metadata()
    except AttributeError:
        return None
    ax = md.get("logical_axes") if isinstance(md, dict) else None
    return tuple(ax) if ax is not None else None


def param_spec(var, mesh: Mesh) -> PartitionSpec:
    """``PartitionSpec`` of one NNX Variable (abstract or concrete) on ``mesh``."""
    ax = _logical_axes(var)
    shape = tuple(var.shape) if hasattr(var, "shape") else tuple(var.get_value().shape)
    if ax is None:
        return PartitionSpec()
    return logical_to_spec(ax, mesh, shape)


def _wanted_spec(var, mesh: Mesh) -> PartitionSpec:
    ax = _logical_axes(var)
    return PartitionSpec() if ax is None else logical_to_spec(ax, mesh, None)


def state_shardings(abstract_state, mesh: Mesh):
    """An NNX ``State`` shaped like ``abstract_state`` whose Variables hold ``NamedSharding``s
    (``sh_flat = dict(nnx.to_flat_state(result)); sh_flat[path].get_value()``)."""
    out = []
    fallbacks = []
    for path, var in nnx.to_flat_state(abstract_state):
        spec = param_spec(var, mesh)
        want = _wanted_spec(var, mesh)
        if spec != want:
            fallbacks.append((".".join(str(p) for p in path), tuple(var.shape), want, spec))
        out.append((path, var.replace(NamedSharding(mesh, spec))))
    if fallbacks:
        head = "; ".join(f"{n} {s}: {w} -> {g}" for n, s, w, g in fallbacks[:4])
        log.info("%d parameters not divisible over their mesh axes, fell back (%s%s)", len(fallbacks), head,
                 " ..." if len(fallbacks) > 4 else "")
    return nnx.from_flat_state(out)


def flat_shardings(shardings) -> dict[tuple, NamedSharding]:
    """``{path: NamedSharding}`` of a ``state_shardings`` result."""
    res = {}
    for path, sh in nnx.to_flat_state(shardings):
        res[path] = sh.get_value() if hasattr(sh, "get_value") else sh
    return res


def shard_state(state, mesh: Mesh):
    """``device_put`` every array of an NNX state with its ``state_shardings`` sharding."""
    sh = flat_shardings(state_shardings(state, mesh))
    out = []
    for path, var in nnx.to_flat_state(state):
        out.append((path, var.replace(jax.device_put(var.get_value(), sh[path]))))
    return nnx.from_flat_state(out)


def shard_model(model, mesh: Mesh):
    """Place an existing model's parameters on ``mesh`` (in place; returns the model)."""
    state = nnx.state(model)
    nnx.update(model, shard_state(state, mesh))
    return model


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def cache_shardings(cache: Any, mesh: Mesh):
    """Shardings of a ``ModelCache`` (or any pytree of arrays / ShapeDtypeStructs): replicated
    for now (every dp shard holds every slot; slot-sharded caches come with the dp engine)."""
    rep = replicated(mesh)
    return jax.tree.map(lambda _: rep, cache)


def shard_cache(cache: Any, mesh: Mesh):
    """``device_put`` a cache pytree with ``cache_shardings``."""
    return jax.device_put(cache, cache_shardings(cache, mesh))
