"""Builds the C++ custom-call targets of deepinfer_jax/kernels_ascend (metadata: pyproject.toml).

* ``_cpu_targets``: the CPU implementation of every target (the test build), compiled against
  the XLA FFI headers jaxlib ships. Optional: without a compiler (or jaxlib's headers) the
  install still succeeds, and only ``kernels="ffi"`` reports what is missing.
* ``ascend/_ascend_targets``: the Ascend device launches, only when the CANN toolkit is found
  (``$ASCEND_TOOLKIT_HOME``, or ``$ASCEND_HOME_PATH``); never built on this repository's CI.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

CSRC = Path("deepinfer_jax/kernels_ascend/csrc")
ASCEND_CSRC = Path("deepinfer_jax/kernels_ascend/ascend/csrc")
CXXFLAGS = ["-O2", "-g0", "-std=c++17", "-fvisibility=hidden"]  # -g0: Python's default CFLAGS add -g


def ffi_include_dir() -> str | None:
    """jaxlib's XLA FFI headers (``jax.ffi.include_dir()`` without importing jax)."""
    try:
        import jaxlib
    except ImportError:
        return None
    inc = Path(jaxlib.__file__).parent / "include"
    return str(inc) if (inc / "xla" / "ffi" / "api" / "ffi.h").is_file() else None


def cann_home() -> Path | None:
    for var in ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH"):
        if os.environ.get(var) and Path(os.environ[var], "include", "acl", "acl.h").is_file():
            return Path(os.environ[var])
    return None


class OptionalBuildExt(build_ext):
    """A failed extension build is a warning (the jnp references need no compiled code)."""

    def run(self):
        try:
            super().run()
        except Exception as e:  # e.g. no compiler at all
            self._warn(f"{type(e).__name__}: {e}")

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as e:
            self._warn(f"{ext.name}: {type(e).__name__}: {e}")

    @staticmethod
    def _warn(msg: str) -> None:
        print(f"WARNING: deepinfer_jax custom-call targets not built ({msg}); kernels='ffi' will "
              "say what to install, the other kernel backends work.", file=sys.stderr)


def extensions() -> list[Extension]:
    inc = ffi_include_dir()
    if inc is None:
        print("WARNING: jaxlib's XLA FFI headers not found; kernels_ascend targets not built.", file=sys.stderr)
        return []
    # -isystem: the FFI headers' own warnings are not ours
    flags = CXXFLAGS + ["-isystem", inc]
    exts = [Extension("deepinfer_jax.kernels_ascend._cpu_targets",
                      sources=[str(p) for p in sorted(CSRC.glob("*.cc"))],
                      depends=[str(CSRC / "common.h")], extra_compile_args=flags, language="c++",
                      optional=True)]
    home = cann_home()
    if home is not None:
        exts.append(Extension("deepinfer_jax.kernels_ascend.ascend._ascend_targets",
                              sources=[str(p) for p in sorted(ASCEND_CSRC.glob("*.cc"))],
                              include_dirs=[str(home / "include")], library_dirs=[str(home / "lib64")],
                              libraries=["ascendcl", "nnopbase", "opapi"],
                              define_macros=[("DEEPINFER_WITH_CANN", "1")],
                              extra_compile_args=flags, language="c++", optional=True))
    return exts


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
