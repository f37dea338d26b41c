"""Lower Pallas Triton kernels for an SM90 GPU (H100 / H200) on a host that has none.

While Pallas lowers a Triton kernel it asks JAX's GPU description (``get_gpu_info``) for the
target's compute capability; a CPU host has no GPU to describe. ``lowering_as_sm90()`` answers for
one. The description lives in JAX's private tree and moved in jax 0.12.1
(``jax._src.pallas.triton.gpu_info`` -> ``jax._src.gpu_info``); ``jax_gpu_info()`` finds it in
either place, so the CPU lowering tests and the offline-lowering scripts run on every jax in
pyproject.toml's range.
"""

from __future__ import annotations

import contextlib
import types


def jax_gpu_info() -> types.ModuleType:
    """JAX's GPU-description module (``GpuInfo``, ``GpuVersion``, ``get_gpu_info``)."""
    try:
        from jax._src import gpu_info  # jax >= 0.12.1
    except ImportError:
        from jax._src.pallas.triton import gpu_info  # jax 0.11.2 .. 0.12.0.1
    return gpu_info


def sm90_info():
    """The description of an SM90 device (an H200: compute capability 90)."""
    gi = jax_gpu_info()
    return gi.GpuInfo(gpu_version=gi.GpuVersion.H200, arch_name="9.0", compute_capability=90)


@contextlib.contextmanager
def lowering_as_sm90():
    """Inside, Pallas lowers Triton kernels as for an SM90 GPU; the previous answer is restored after."""
    gi = jax_gpu_info()
    saved = gi.get_gpu_info
    gi.get_gpu_info = sm90_info
    try:
        yield
    finally:
        gi.get_gpu_info = saved
