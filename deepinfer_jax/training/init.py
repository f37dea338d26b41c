"""Initial weights of a model to train: the seeded random-checkpoint values
(``checkpoint/random_checkpoint.py``: per-tensor generators, the golden models' distributions),
built in memory with no files."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from deepinfer_jax.checkpoint.random_checkpoint import random_tensor_values
from deepinfer_jax.checkpoint.spec import checkpoint_spec
from deepinfer_jax.models.weights import abstract_model, file_names_of, param_path_name


def init_model(cfg, seed: int = 0):
    """``DeepseekV41ForCausalLM`` of ``cfg`` with seed ``seed``'s random-checkpoint weights
    (the same values ``write_random_checkpoint(cfg, dir, seed)`` + ``load_model(dir)`` give)."""
    spec = checkpoint_spec(cfg)
    graphdef, abstract = abstract_model(cfg)
    values = []
    for path, var in nnx.to_flat_state(abstract):
        name = param_path_name(path)
        names = file_names_of(name, var.shape[0]) if ".ffn.experts." in name else [name]
        parts = []
        for n in names:
            wname = n[: -len(".scale")] + ".weight" if n.endswith(".scale") else n
            parts.append(random_tensor_values(wname, spec[wname], cfg, seed)[n])
        arr = np.stack(parts) if len(names) > 1 or names[0] != name else parts[0]
        if arr.dtype == np.int8:  # fp4 codes: held as uint8 (same bytes)
            arr = arr.view(np.uint8)
        if tuple(arr.shape) != tuple(var.shape):
            raise AssertionError(f"{name}: init shape {arr.shape} != model {var.shape}")
        values.append((path, var.replace(jnp.asarray(arr, var.dtype))))
    return nnx.merge(graphdef, nnx.from_flat_state(values))
