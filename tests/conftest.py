"""Shared pytest fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import deepinfer_jax  # noqa: F401  (first: it sets the XLA numerics flags before any backend starts;
# KERNEL_MODES below asks JAX for its backend at collection time)

REPO_ROOT = Path(__file__).resolve().parent.parent
# the CLI turns JAX's persistent compilation cache on by default (a process-wide setting): the
# suite keeps it off, so no test writes to the user's cache or reads another run's entries
os.environ["DEEPINFER_COMPILE_CACHE"] = "0"


def pytest_report_header(config):
    from importlib.metadata import version

    return "stack: " + ", ".join(f"{p} {version(p)}" for p in ("jax", "jaxlib", "flax", "orbax-checkpoint", "numpy"))


def load_script(name: str):
    """``scripts/<name>.py`` as a module (registered under ``name``: its dataclasses look their
    module up), for the tests of benchmark helpers that are scripts, not package modules."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def golden_root() -> Path:
    """The v41_tiny golden data: ``$DEEPINFER_GOLDEN`` or the vendored ``tests/golden/v41_tiny``."""
    env = os.environ.get("DEEPINFER_GOLDEN")
    return Path(env) if env else REPO_ROOT / "tests" / "golden" / "v41_tiny"


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    """The golden data; missing data is a failure, never a skip (it ships with the repository)."""
    root = golden_root()
    if not (root / "tiny_fp8" / "golden.npz").is_file():
        pytest.fail(f"golden data not found at {root}: the repository ships it under tests/golden/ "
                    "(or set DEEPINFER_GOLDEN to a copy)")
    return root


def on_gpu() -> bool:
    try:
        import jax

        return jax.default_backend() == "gpu"
    except Exception:
        return False


# (interpret, marks) of a kernel test: the CPU run interprets; the device run (-m device) compiles.
KERNEL_MODES = [
    pytest.param(True, id="interpret"),
    pytest.param(False, id="gpu", marks=[pytest.mark.device, pytest.mark.skipif(not on_gpu(), reason="needs a GPU")]),
]


@pytest.fixture
def sm90_lowering(monkeypatch):
    """Lower Pallas Triton kernels for an H200 on a machine without a GPU (``lowering_platforms=
    ("cuda",)``): Pallas asks the local GPU for its compute capability; this answers for it."""
    import warnings

    from deepinfer_jax.kernels_pallas.sm90_target import jax_gpu_info, sm90_info

    monkeypatch.setattr(jax_gpu_info(), "get_gpu_info", sm90_info)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # "Pallas Triton backend is deprecated"
        yield


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """After each test module, drop JAX's compiled programs and tracing caches: the suite runs in
    one process and compiles several hundred programs (models up to the 40M-parameter shipped
    one); unreleased, they pile up for the whole run. (jax 0.12.0.1's CPU compiler once
    segfaulted late in such a run; with this the process holds one module's programs at a time.)"""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()
