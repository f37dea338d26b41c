"""Check a checkpoint's tensor names, dtypes and shapes against ``checkpoint_spec(cfg)``."""

from __future__ import annotations

import os
from typing import Any

from deepinfer_jax.checkpoint.spec import checkpoint_spec

__all__ = ["check_checkpoint", "checkpoint_problems"]

MAX_LISTED = 10


def _fmt(dtype: str, shape: tuple[int, ...]) -> str:
    return f"{dtype} {list(shape)}"


def checkpoint_problems(cfg: Any, reader: Any) -> list[str]:
    """Every mismatch between ``reader`` (anything with ``keys()`` and ``spec(name) ->
    (dtype, shape)``, e.g. a ``CheckpointReader``) and ``checkpoint_spec(cfg)``, one line each,
    in spec order then unexpected tensors."""
    want = checkpoint_spec(cfg)
    have = list(reader.keys())
    have_set = set(have)
    problems = []
    for name, s in want.items():
        if name not in have_set:
            problems.append(f"missing tensor {name!r} (expected {_fmt(s.file_dtype, s.shape)})")
            continue
        dtype, shape = reader.spec(name)
        shape = tuple(int(x) for x in shape)
        if dtype != s.file_dtype or shape != s.shape:
            what = []
            if dtype != s.file_dtype:
                what.append("dtype")
            if shape != s.shape:
                what.append("shape")
            problems.append(
                f"wrong {' and '.join(what)} for tensor {name!r}: expected "
                f"{_fmt(s.file_dtype, s.shape)}, found {_fmt(dtype, shape)}"
            )
    for name in have:
        if name not in want:
            dtype, shape = reader.spec(name)
            problems.append(f"unexpected tensor {name!r} (found {_fmt(dtype, tuple(shape))}, expected none)")
    return problems


def check_checkpoint(cfg: Any, reader: Any) -> None:
    """Raise ``ValueError`` listing (the first few of) all problems: missing tensors, unexpected
    tensors, wrong shapes, wrong dtypes. ``reader`` may also be a checkpoint directory path."""
    if isinstance(reader, (str, os.PathLike)):
        from deepinfer_jax.checkpoint.safetensors_io import open_checkpoint_dir

        reader = open_checkpoint_dir(reader)
    problems = checkpoint_problems(cfg, reader)
    if not problems:
        return
    where = getattr(reader, "directory", None)
    head = f"checkpoint{f' {where}' if where else ''} does not match the config: {len(problems)} problem(s):"
    lines = [head] + [f"  - {p}" for p in problems[:MAX_LISTED]]
    if len(problems) > MAX_LISTED:
        lines.append(f"  ... and {len(problems) - MAX_LISTED} more")
    raise ValueError("\n".join(lines))
