"""Loading the compiled targets and registering them with XLA (once per process and platform)."""

from __future__ import annotations

import importlib
import threading

import jax

from deepinfer_jax.kernels_ascend.errors import FfiUnavailable

__all__ = ["FfiUnavailable", "available", "register"]

CPU_MODULE = "deepinfer_jax.kernels_ascend._cpu_targets"
_lock = threading.Lock()
_registered: set[str] = set()


def _cpu_capsules() -> dict:
    try:
        mod = importlib.import_module(CPU_MODULE)
    except ImportError as e:
        raise FfiUnavailable(
            f"kernels='ffi' needs the C++ CPU targets ({CPU_MODULE}), which were not built ({e}). "
            "They compile at install time when a C++17 compiler is present: install g++ (>= 9) and "
            "reinstall the package (`pip install -e .` from the repository; `pip install -v` shows the "
            "build log). kernels='auto' or 'reference' do not need them.") from None
    return mod.targets()


def register(platform: str) -> None:
    """Register every target for ``platform`` ("cpu", or an Ascend platform name); idempotent."""
    with _lock:
        if platform in _registered:
            return
        if platform == "cpu":
            capsules = _cpu_capsules()
        else:
            from deepinfer_jax.kernels_ascend.ascend import device_targets

            capsules = device_targets.capsules(platform)
        jax.devices()  # backends up first: a refused registration then raises here, not at their start
        for name, capsule in capsules.items():
            try:
                jax.ffi.register_ffi_target(name, capsule, platform=platform)
            except Exception as e:  # e.g. targets built against newer FFI headers than this jaxlib
                raise FfiUnavailable(f"XLA refused the custom-call target {name} on {platform}: {e}. "
                                     "Reinstall the package so it builds against this jaxlib.") from None
        _registered.add(platform)


def available(platform: str = "cpu") -> bool:
    """Whether the targets of ``platform`` can be registered (without raising)."""
    try:
        register(platform)
    except FfiUnavailable:
        return False
    return True
