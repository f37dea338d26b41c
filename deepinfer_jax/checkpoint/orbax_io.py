"""Orbax model directories: the NNX parameter state saved with orbax-checkpoint.

Layout of an Orbax model directory::

    out_dir/config.json      # ModelConfig.to_json (same as the safetensors directory)
    out_dir/params/          # orbax StandardCheckpointer (OCDBT + zarr3) of the parameters
    out_dir/tokenizer.json   # copied from the source directory when it has one
                             # (+ tokenizer_config.json)

The parameter tree is a nested dict of plain string keys: the NNX path of each parameter
(``layers / 0 / ffn / experts / w1 / weight``), i.e. the tensor names of the model with stacked
routed experts. Only arrays are stored (no NNX Variable metadata), so a checkpoint does not
depend on how a Flax version flattens Variables; the structure comes from the model built from
``config.json``. Storage dtypes are kept bit for bit (float8_e4m3fn weights, uint8 fp4 codes
and ue8m0 scales, bf16, f32).

Restoring takes the model's abstract state (``models/weights.py`` builds it from
``config.json``) and fills it, straight into the target shardings
(``sharding/partition.state_shardings``) when a mesh is given: every device reads only its own
shards. ``models/weights.load_model`` reads these directories; ``models/convert.py`` writes them
from a safetensors directory.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import jax
from flax import nnx

from deepinfer_jax.config import ModelConfig

PARAMS_DIR = "params"
_COPY_FILES = ("tokenizer.json", "tokenizer_config.json")


def is_orbax_dir(model_dir: str | os.PathLike) -> bool:
    return os.path.isdir(os.path.join(os.fspath(model_dir), PARAMS_DIR))


def _nest(items) -> dict:
    """``[(path, value)]`` -> nested dict with string keys."""
    root: dict = {}
    for path, value in items:
        d = root
        for p in path[:-1]:
            d = d.setdefault(str(p), {})
        d[str(path[-1])] = value
    return root


def _lookup(tree: dict, path) -> Any:
    for p in path:
        tree = tree[str(p)]
    return tree


def _param_state(model_or_state):
    if isinstance(model_or_state, nnx.Module):
        return nnx.state(model_or_state)
    return model_or_state


def save_orbax(model_or_state, out_dir: str | os.PathLike, cfg: ModelConfig | None = None,
               src_dir: str | os.PathLike | None = None, force: bool = False) -> str:
    """Write ``model_or_state``'s parameters to ``out_dir/params`` (orbax) plus
    ``out_dir/config.json``; copy the tokenizer files of ``src_dir`` if it has them.
    ``cfg`` defaults to the model's. Arrays may be sharded (each device writes its shards).
    Returns ``out_dir``."""
    import orbax.checkpoint as ocp

    if cfg is None:
        cfg = getattr(model_or_state, "cfg", None)
        if cfg is None:
            raise ValueError("save_orbax: pass cfg when saving a bare state")
    out_dir = os.path.abspath(os.fspath(out_dir))
    state = _param_state(model_or_state)
    tree = _nest((path, var.get_value() if hasattr(var, "get_value") else var)
                 for path, var in nnx.to_flat_state(state))
    os.makedirs(out_dir, exist_ok=True)
    params = os.path.join(out_dir, PARAMS_DIR)
    if os.path.exists(params) and not force:
        raise FileExistsError(f"{params} exists (pass force=True to overwrite)")
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(params, tree, force=force)
    ckpt.wait_until_finished()
    ckpt.close()
    if jax.process_index() == 0:
        cfg.to_json(os.path.join(out_dir, "config.json"))
        if src_dir is not None:
            for name in _COPY_FILES:
                src = os.path.join(os.fspath(src_dir), name)
                if os.path.isfile(src):
                    shutil.copyfile(src, os.path.join(out_dir, name))
    return out_dir


def _flatten(tree, prefix=()) -> dict:
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_flatten(v, prefix + (str(k),)))
        return out
    return {prefix: tree}


def _check_saved(ckpt, params: str, flat) -> None:
    """The saved tree holds exactly the model's parameters, with their shapes and dtypes
    (orbax itself would pad / truncate an array restored with a different global shape)."""
    import numpy as np

    meta = ckpt.metadata(params)
    tree = getattr(meta, "item_metadata", meta)
    tree = getattr(tree, "tree", tree)
    saved = {".".join(k): v for k, v in _flatten(tree).items()}
    want = {".".join(map(str, path)): var for path, var in flat}
    missing = sorted(want.keys() - saved.keys())
    extra = sorted(saved.keys() - want.keys())
    bad = [f"{n}: saved {np.dtype(saved[n].dtype)}{tuple(saved[n].shape)}, model {np.dtype(want[n].dtype)}"
           f"{tuple(want[n].shape)}" for n in sorted(want.keys() & saved.keys())
           if tuple(saved[n].shape) != tuple(want[n].shape) or np.dtype(saved[n].dtype) != np.dtype(want[n].dtype)]
    if missing or extra or bad:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing (e.g. {missing[:3]})")
        if extra:
            parts.append(f"{len(extra)} not in the model (e.g. {extra[:3]})")
        if bad:
            parts.append(f"{len(bad)} mismatched ({'; '.join(bad[:3])})")
        raise ValueError(f"{params} does not match the model of config.json: " + ", ".join(parts))


def restore_orbax_state(model_dir: str | os.PathLike, abstract, mesh=None):
    """The abstract NNX ``state`` filled from an Orbax model directory. With ``mesh``, every
    array is restored straight into its ``state_shardings`` sharding (each device reads only its
    shards); without, arrays are read to host and placed like the safetensors loader places them
    (uncommitted, on the default device), so both loaders give interchangeable states."""
    import jax.numpy as jnp
    import numpy as np
    import orbax.checkpoint as ocp

    model_dir = os.path.abspath(os.fspath(model_dir))
    flat = list(nnx.to_flat_state(abstract))
    if mesh is not None:
        from deepinfer_jax.sharding.partition import flat_shardings, state_shardings

        sh = flat_shardings(state_shardings(abstract, mesh))
        restore_args = _nest((path, ocp.ArrayRestoreArgs(sharding=sh[path], global_shape=tuple(var.shape),
                                                         dtype=var.dtype)) for path, var in flat)
    else:
        restore_args = _nest((path, ocp.RestoreArgs(restore_type=np.ndarray, dtype=var.dtype)) for path, var in flat)
    params = os.path.join(model_dir, PARAMS_DIR)
    ckpt = ocp.PyTreeCheckpointer()
    try:
        _check_saved(ckpt, params, flat)
        restored = ckpt.restore(params, args=ocp.args.PyTreeRestore(restore_args=restore_args))
    finally:
        ckpt.close()
    values = []
    for path, var in flat:
        name = ".".join(map(str, path))
        try:
            arr = _lookup(restored, path)
        except KeyError:
            raise ValueError(f"{params} has no parameter {name}") from None
        if tuple(arr.shape) != tuple(var.shape) or arr.dtype != var.dtype:
            raise ValueError(f"parameter {name}: checkpoint has {arr.dtype}{tuple(arr.shape)}, "
                             f"model expects {var.dtype}{tuple(var.shape)}")
        values.append((path, var.replace(arr if mesh is not None else jnp.asarray(arr))))
    return nnx.from_flat_state(values)
