"""JAX's persistent compilation cache for engine starts (``LLM(compile_cache=...)``, the CLI's
``--compile-cache``, ``$DEEPINFER_COMPILE_CACHE``).

An engine compiles every step variant when it starts. With the cache on, a later start of the same
model and configuration loads those executables from disk instead of compiling them again. On a
2-core CPU this cuts the shipped model's start from 15.7 s to 7.5 s (XLA 11.8 -> 2.5 s;
``scripts/compile_profile.py --cache-dir``). Tracing and lowering still run, and the cache key
is the lowered program, so a changed model, configuration or jax version compiles afresh.

The setting is process-wide (it is JAX's): every later compile of the process may use it. Only
compiles that take at least a second are written (JAX's default threshold), and the directory is
capped at ``MAX_BYTES`` (least recently used entries go first) unless the process set its own cap
or the ``filelock`` package JAX's cap needs is missing.
"""

from __future__ import annotations

import importlib.util
import logging
import os

ENV = "DEEPINFER_COMPILE_CACHE"
MAX_BYTES = 4 << 30
_OFF = {"", "0", "off", "false", "no"}
log = logging.getLogger(__name__)


def default_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "deepinfer_jax", "xla")


def resolve(setting) -> str | None:
    """The cache directory for ``setting``: ``None`` reads ``$DEEPINFER_COMPILE_CACHE`` (a
    directory, or 0/off to disable; unset: off), ``False`` is off, ``True`` the default
    directory (``~/.cache/deepinfer_jax/xla``), a string that directory."""
    if setting is None:
        env = os.environ.get(ENV)
        if env is None:
            return None
        setting = False if env.strip().lower() in _OFF else env
    if setting is False:
        return None
    if setting is True:
        return default_dir()
    if not isinstance(setting, (str, os.PathLike)):
        raise ValueError(f"compile_cache={setting!r}: expected a directory path, True, False or None")
    path = os.path.abspath(os.path.expanduser(os.fspath(setting)))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"compile_cache={os.fspath(setting)!r}: {path} exists and is not a directory")
    return path


def enable(path: str) -> None:
    """Point JAX's persistent compilation cache at ``path`` for the rest of the process."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache as cc

    os.makedirs(path, exist_ok=True)
    if jax.config.jax_compilation_cache_dir == path:
        return
    jax.config.update("jax_compilation_cache_dir", path)
    # JAX's size cap needs the filelock package (torch brings it; a bare install may not have it)
    if jax.config.jax_compilation_cache_max_size == -1 and importlib.util.find_spec("filelock") is not None:
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    # JAX decides once per process, at its first compile, whether a cache is in use: start over
    cc.reset_cache()
    log.info("persistent compilation cache: %s", path)
