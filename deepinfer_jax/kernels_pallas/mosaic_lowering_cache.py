"""One Mosaic GPU lowering per distinct kernel call, shared by the step variants of a process.

An engine lowers one step program per token bucket (and step kind), and each program lowers its
Pallas kernels afresh: JAX caches a kernel's lowering only within one program. For Mosaic GPU
kernels (the fp8 MoE kernel) that lowering, mostly Mosaic's layout inference, is most of a GPU
start-up's serial Python time (``scripts/gpu_lowering_profile.py`` prints it per variant), and a
call whose inputs do not depend on the bucket (the DSpark stages' MoE, sized by the request
count) is lowered identically in every variant.

``install()`` wraps JAX's ``lower_unpipelined_jaxpr_to_module`` (the Mosaic GPU lowering of a
``plgpu.kernel`` body) with a memo keyed by everything the lowering reads: the kernel body's
jaxpr text, the kernel function, its input and output types, the compiler parameters, the GPU
mesh (grid) and the JAX mesh. The memo returns the earlier ``LoweringResult``; JAX serialises
its module into each program's custom call, so programs lowered with and without the memo are
the same text (``tests/test_mosaic_lowering_cache.py``). Where JAX has no such function
(another release), nothing is installed and lowering works as before.

**Stable kernel names.** JAX names each lowered kernel module ``kernel_N``
(``mosaic_gpu.dump_basename``, for its debug dumps) from a process-wide counter, and the name is
serialised into the program's custom call and its ``kernel_hash``. A step program's text, and
with it its key in the persistent compilation cache, then depended on how many kernels the
process had lowered before it: another bucket order, a start with other engines first or the
compile threads' interleaving gave other keys, and a warm start missed the cache. The wrapper
renames every lowered module after its content (``kernel_<sha256 of its bytecode>``), so equal
kernels get equal names in any process and order (also with the memo off). jax 0.12 leaves the
name out of the kernel it serialises, so there the renaming changes nothing.

Installed when the GPU kernels load (``ops._load_kernels``); ``DEEPINFER_MOSAIC_LOWERING_CACHE=0``
turns the memo off (the names stay stable).
"""

from __future__ import annotations

import collections
import hashlib
import io
import logging
import threading

_log = logging.getLogger(__name__)
MAX_ENTRIES = 256  # least recently used entries go first (engines of other shapes, later)
_CACHE: collections.OrderedDict[tuple, object] = collections.OrderedDict()
_LOCK = threading.Lock()
_STATS = {"hits": 0, "misses": 0}
_INSTALLED: list = []  # (module, original function) once installed
_MEMO = [True]          # whether lowerings are kept (install(memo=...))
NAME_ATTR = "mosaic_gpu.dump_basename"


def stable_name(module) -> str:
    """Name the lowered kernel ``module`` (an MLIR module) after its content, replacing JAX's
    counter-based ``kernel_N``; returns the name."""
    from jax._src.lib.mlir import ir

    attrs = module.operation.attributes
    attrs[NAME_ATTR] = ir.StringAttr.get("kernel")  # (the name itself out of the hash)
    buf = io.BytesIO()
    module.operation.write_bytecode(buf)
    name = "kernel_" + hashlib.sha256(buf.getvalue()).hexdigest()[:16]
    attrs[NAME_ATTR] = ir.StringAttr.get(name)
    return name


def _key(mesh, jax_mesh, jaxpr, in_shapes, out_shapes, params, outer_traceback) -> tuple:
    info = getattr(jaxpr, "debug_info", None)
    frame = None
    if outer_traceback is not None:  # the call site's location becomes the kernel's base location
        from jax._src import source_info_util

        f = source_info_util.user_frame(outer_traceback)
        frame = (f.file_name, f.start_line, f.start_column) if f is not None else None
    return (str(jaxpr), getattr(info, "func_src_info", None), tuple(map(str, in_shapes)),
            tuple(map(str, out_shapes)), repr(params), repr(mesh), repr(jax_mesh), frame)


def install(memo: bool = True) -> bool:
    """Put the memo (``memo``) and the stable names in front of JAX's Mosaic GPU kernel lowering
    (once; a later call sets ``memo``); False where this JAX has no
    ``lower_unpipelined_jaxpr_to_module`` to wrap."""
    _MEMO[0] = memo
    if _INSTALLED:
        return True
    try:
        from jax._src.pallas.mosaic_gpu import lowering
    except Exception:  # no Mosaic GPU in this jaxlib
        return False
    orig = getattr(lowering, "lower_unpipelined_jaxpr_to_module", None)
    if orig is None:
        return False

    def lowered(*args, **kw):
        out = orig(*args, **kw)
        module = getattr(out, "module", None)
        if module is not None:
            try:
                stable_name(module)
            except Exception as e:  # another JAX's result: its own name stays (a debug dump name)
                _log.debug("Mosaic GPU kernel not renamed: %s", e)
        return out

    def lower_unpipelined_jaxpr_to_module(mesh, jax_mesh, jaxpr, in_shapes, out_shapes, params, *,
                                          outer_traceback=None):
        if not _MEMO[0]:
            return lowered(mesh, jax_mesh, jaxpr, in_shapes, out_shapes, params, outer_traceback=outer_traceback)
        try:
            key = _key(mesh, jax_mesh, jaxpr, in_shapes, out_shapes, params, outer_traceback)
        except Exception:  # an argument JAX changed shape: lower as JAX would
            return lowered(mesh, jax_mesh, jaxpr, in_shapes, out_shapes, params, outer_traceback=outer_traceback)
        with _LOCK:
            hit = _CACHE.get(key)
            if hit is not None:
                _CACHE.move_to_end(key)
        if hit is not None:
            _STATS["hits"] += 1
            return hit
        out = lowered(mesh, jax_mesh, jaxpr, in_shapes, out_shapes, params, outer_traceback=outer_traceback)
        with _LOCK:
            _CACHE[key] = out
            while len(_CACHE) > MAX_ENTRIES:
                _CACHE.popitem(last=False)
        _STATS["misses"] += 1
        return out

    lowering.lower_unpipelined_jaxpr_to_module = lower_unpipelined_jaxpr_to_module
    _INSTALLED.append((lowering, orig))
    _log.debug("Mosaic GPU lowering memo installed")
    return True


def installed() -> bool:
    return bool(_INSTALLED)


def uninstall() -> None:
    """Restore JAX's own lowering and drop the memo (tests)."""
    while _INSTALLED:
        mod, orig = _INSTALLED.pop()
        mod.lower_unpipelined_jaxpr_to_module = orig
    clear()


def clear() -> None:
    with _LOCK:
        _CACHE.clear()
    _STATS.update(hits=0, misses=0)


def stats() -> dict:
    """Lowerings served from the memo (``hits``) and done by JAX (``misses``) since the last clear."""
    return dict(_STATS, entries=len(_CACHE))
