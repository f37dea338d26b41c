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
the same text (``tests/test_mosaic_lowering_cache.py``; JAX's lowering differs between two
runs only in a dump file name, ``mosaic_gpu.dump_basename``, from a global counter). Where JAX
has no such function (another release), nothing is installed and lowering works as before.
Installed when the GPU kernels load (``ops._load_kernels``); ``DEEPINFER_MOSAIC_LOWERING_CACHE=0``
leaves JAX's lowering alone.
"""

from __future__ import annotations

import collections
import logging
import threading

_log = logging.getLogger(__name__)
MAX_ENTRIES = 256  # least recently used entries go first (engines of other shapes, later)
_CACHE: collections.OrderedDict[tuple, object] = collections.OrderedDict()
_LOCK = threading.Lock()
_STATS = {"hits": 0, "misses": 0}
_INSTALLED: list = []  # (module, original function) once installed


def _key(mesh, jax_mesh, jaxpr, in_shapes, out_shapes, params, outer_traceback) -> tuple:
    info = getattr(jaxpr, "debug_info", None)
    frame = None
    if outer_traceback is not None:  # the call site's location becomes the kernel's base location
        from jax._src import source_info_util

        f = source_info_util.user_frame(outer_traceback)
        frame = (f.file_name, f.start_line, f.start_column) if f is not None else None
    return (str(jaxpr), getattr(info, "func_src_info", None), tuple(map(str, in_shapes)),
            tuple(map(str, out_shapes)), repr(params), repr(mesh), repr(jax_mesh), frame)


def install() -> bool:
    """Put the memo in front of JAX's Mosaic GPU kernel lowering (once); False where this JAX
    has no ``lower_unpipelined_jaxpr_to_module`` to wrap."""
    if _INSTALLED:
        return True
    try:
        from jax._src.pallas.mosaic_gpu import lowering
    except Exception:  # no Mosaic GPU in this jaxlib
        return False
    orig = getattr(lowering, "lower_unpipelined_jaxpr_to_module", None)
    if orig is None:
        return False

    def lower_unpipelined_jaxpr_to_module(mesh, jax_mesh, jaxpr, in_shapes, out_shapes, params, *,
                                          outer_traceback=None):
        try:
            key = _key(mesh, jax_mesh, jaxpr, in_shapes, out_shapes, params, outer_traceback)
        except Exception:  # an argument JAX changed shape: lower as JAX would
            return orig(mesh, jax_mesh, jaxpr, in_shapes, out_shapes, params, outer_traceback=outer_traceback)
        with _LOCK:
            hit = _CACHE.get(key)
            if hit is not None:
                _CACHE.move_to_end(key)
        if hit is not None:
            _STATS["hits"] += 1
            return hit
        out = orig(mesh, jax_mesh, jaxpr, in_shapes, out_shapes, params, outer_traceback=outer_traceback)
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
