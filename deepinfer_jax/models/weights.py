"""Load DeepSeek-V4.1 weights from a model directory (config.json + safetensors shards, official
tensor names) into ``DeepseekV41ForCausalLM``, keeping quantized weights quantized.

A parameter's NNX path joined by dots is its tensor name, except stacked routed experts:
``layers.N.ffn.experts.w1.weight [E, ...]`` <- ``layers.N.ffn.experts.{e}.w1.weight``. fp4
experts are stored as I8 in the file and held as uint8 (same bytes); ue8m0 scales as uint8.
A tensor with a NaN or Inf (ue8m0 0xFF included) is refused, naming it (``finite_check``).
With a ``mesh``, every array is built shard by shard from the memory-mapped file
(``jax.make_array_from_callback``), so no device ever holds a full copy of a sharded weight.
"""

from __future__ import annotations

import os
import re
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.models.deepseek_v41 import DeepseekV41ForCausalLM
from deepinfer_jax.checkpoint.finite_check import check_finite

_EXPERT = re.compile(r"^(.*\.ffn\.experts)\.(w[123]\.(?:weight|scale))$")


def param_path_name(path: Iterable) -> str:
    return ".".join(str(p) for p in path)


def file_names_of(name: str, n_experts: int) -> list[str]:
    """Checkpoint tensor names that make up one parameter."""
    m = _EXPERT.match(name)
    if m:
        return [f"{m.group(1)}.{e}.{m.group(2)}" for e in range(n_experts)]
    return [name]


def _as_param_dtype(arr: np.ndarray, dtype, name: str) -> np.ndarray:
    want = np.dtype(dtype)
    if arr.dtype == want:
        return arr
    if arr.dtype == np.int8 and want == np.uint8:  # fp4 codes, two per byte
        return arr.view(np.uint8)
    raise ValueError(f"tensor {name}: file dtype {arr.dtype} does not match the model's {want}")


def abstract_model(cfg: ModelConfig):
    """(graphdef, abstract state) without allocating any weight."""
    model = nnx.eval_shape(lambda: DeepseekV41ForCausalLM(cfg))
    return nnx.split(model)


def tensor_reader(reader, name: str, shape, dtype, n_experts: int) -> Callable[[tuple], np.ndarray]:
    """A function ``index -> np.ndarray`` reading one parameter (or a slice of it) from the file."""
    names = file_names_of(name, n_experts)
    for n in names:
        if n not in reader:
            raise ValueError(f"checkpoint is missing tensor {n}")
    if not _EXPERT.match(name):  # one file tensor (a stack of one expert still goes below)
        arr = reader.get(names[0])
        if tuple(arr.shape) != tuple(shape):
            raise ValueError(f"tensor {names[0]}: shape {tuple(arr.shape)}, model expects {tuple(shape)}")
        check_finite(names[0], arr, reader.spec(names[0])[0])
        arr = _as_param_dtype(arr, dtype, names[0])
        return lambda idx: np.asarray(arr[idx])
    parts = [_as_param_dtype(reader.get(n), dtype, n) for n in names]
    for n, p in zip(names, parts):
        if tuple(p.shape) != tuple(shape[1:]):
            raise ValueError(f"tensor {n}: shape {tuple(p.shape)}, model expects {tuple(shape[1:])}")
        check_finite(n, p, reader.spec(n)[0])

    def read(idx):
        idx = tuple(idx) + (slice(None),) * (len(shape) - len(tuple(idx)))
        es = range(shape[0])[idx[0]]
        return np.stack([np.asarray(parts[e][idx[1:]]) for e in es]) if len(es) else \
            np.zeros((0, *np.empty(shape[1:])[idx[1:]].shape), parts[0].dtype)

    return read


def load_state(cfg: ModelConfig, model_dir: str | os.PathLike, shardings=None, progress: bool = False):
    """Read every parameter of ``cfg``'s model from ``model_dir`` into an NNX state.
    ``shardings``: optional pytree of ``jax.sharding.Sharding`` matching the state."""
    from deepinfer_jax.checkpoint.check import check_checkpoint
    from deepinfer_jax.checkpoint.safetensors_io import open_checkpoint_dir

    reader = open_checkpoint_dir(model_dir)
    check_checkpoint(cfg, reader)
    graphdef, abstract = abstract_model(cfg)
    flat = nnx.to_flat_state(abstract)
    sh_flat = dict(nnx.to_flat_state(shardings)) if shardings is not None else {}
    items = list(flat)
    it = items
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(items, desc="loading weights", unit="tensor")
    values = []
    for path, var in it:
        name = param_path_name(path)
        n_exp = var.shape[0] if _EXPERT.match(name) else 0
        read = tensor_reader(reader, name, var.shape, var.dtype, n_exp)
        sh = sh_flat.get(path)
        if sh is not None:
            sh = sh.get_value() if hasattr(sh, "get_value") else sh
            arr = jax.make_array_from_callback(tuple(var.shape), sh, lambda idx, r=read: r(idx))
        else:
            arr = jnp.asarray(read(()))
        values.append((path, var.replace(arr)))
    return graphdef, nnx.from_flat_state(values)


def load_model(model_dir: str | os.PathLike, cfg: ModelConfig | None = None, mesh=None,
               progress: bool = False) -> DeepseekV41ForCausalLM:
    """Build the model from a model directory (``config.json`` + safetensors, or an Orbax
    directory with ``params/``, see ``checkpoint/orbax_io.py``)."""
    from deepinfer_jax.checkpoint.orbax_io import is_orbax_dir

    if is_orbax_dir(model_dir):
        return load_orbax(model_dir, mesh=mesh, cfg=cfg)
    cfg = cfg or ModelConfig.from_json(model_dir)
    shardings = None
    if mesh is not None:
        from deepinfer_jax.sharding.partition import state_shardings

        shardings = state_shardings(abstract_model(cfg)[1], mesh)
    graphdef, state = load_state(cfg, model_dir, shardings, progress)
    return nnx.merge(graphdef, state)


def load_orbax_state(model_dir: str | os.PathLike, cfg: ModelConfig | None = None, mesh=None):
    """``(graphdef, state)`` of the model in an Orbax model directory (``checkpoint/orbax_io.py``):
    the model's structure from ``config.json``, the arrays from ``params/``."""
    from deepinfer_jax.checkpoint.orbax_io import restore_orbax_state

    cfg = cfg or ModelConfig.from_json(model_dir)
    graphdef, abstract = abstract_model(cfg)
    return graphdef, restore_orbax_state(model_dir, abstract, mesh)


def load_orbax(model_dir: str | os.PathLike, mesh=None, cfg: ModelConfig | None = None):
    """Build ``DeepseekV41ForCausalLM`` from an Orbax model directory (see ``load_orbax_state``)."""
    graphdef, state = load_orbax_state(model_dir, cfg, mesh)
    return nnx.merge(graphdef, state)
