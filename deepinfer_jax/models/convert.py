"""Safetensors model directory -> Orbax model directory (``deepinfer-jax convert``).

The weights pass through the devices: on one device by default, or spread over ``mesh`` (each
device reads and writes only its shards) for models larger than one device. ``JAX_PLATFORMS=cpu``
converts in host memory. The directory layout is ``checkpoint/orbax_io.py``'s.
"""

from __future__ import annotations

import os

from deepinfer_jax.checkpoint.orbax_io import PARAMS_DIR, is_orbax_dir, save_orbax
from deepinfer_jax.config import ModelConfig
from deepinfer_jax.models.weights import load_model


def convert(src_model_dir: str | os.PathLike, out_dir: str | os.PathLike, progress: bool = True,
            mesh=None, force: bool = False) -> str:
    """Write the Orbax copy of ``src_model_dir`` to ``out_dir``; returns ``out_dir``."""
    src_model_dir = os.fspath(src_model_dir)
    if is_orbax_dir(src_model_dir):
        raise ValueError(f"{src_model_dir} is already an Orbax model directory")
    cfg = ModelConfig.from_json(src_model_dir)
    model = load_model(src_model_dir, cfg=cfg, mesh=mesh, progress=progress)
    if progress:
        print(f"writing {os.path.join(os.fspath(out_dir), PARAMS_DIR)} ...", flush=True)
    return save_orbax(model, out_dir, cfg, src_dir=src_model_dir, force=force)
