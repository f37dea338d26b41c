"""Save and resume a training run: ``<dir>/state.npz`` holds the fp32 master weights, the optimizer
state (every leaf, in tree order) and the step (= data position, see ``data.py``); ``meta.json``
the run's settings. Written to a temporary file and renamed, so a run cut mid-write keeps the
previous state. The arrays are stored bit for bit, so a resumed run continues exactly."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.training.step import TrainState

STATE_FILE = "state.npz"
META_FILE = "meta.json"
# a run's files are ``<prefix>state.npz`` / ``<prefix>meta.json``: the DSpark stages' run uses
# ``DSPARK_PREFIX``, so it can live beside the backbone run it starts from
DSPARK_PREFIX = "dspark_"


def _leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def save_state(out_dir: str | os.PathLike, state: TrainState, meta: dict, prefix: str = "") -> str:
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    arrays = {f"master_{i}": a for i, a in enumerate(_leaves(state.master))}
    arrays |= {f"opt_{i}": a for i, a in enumerate(_leaves(state.opt_state))}
    arrays["step"] = np.asarray(state.step, np.int64)
    path = os.path.join(out_dir, prefix + STATE_FILE)
    tmp = path + ".tmp.npz"
    np.savez(tmp, **arrays)
    os.replace(tmp, path)
    meta_path = os.path.join(out_dir, prefix + META_FILE)
    with open(meta_path + ".tmp", "w") as f:
        json.dump(meta | {"step": int(state.step)}, f, indent=2)
    os.replace(meta_path + ".tmp", meta_path)
    return path


def has_state(out_dir: str | os.PathLike, prefix: str = "") -> bool:
    return os.path.isfile(os.path.join(os.fspath(out_dir), prefix + STATE_FILE))


def load_meta(out_dir: str | os.PathLike, prefix: str = "") -> dict:
    with open(os.path.join(os.fspath(out_dir), prefix + META_FILE)) as f:
        return json.load(f)


def _fill(template, arrays, prefix: str, path: str):
    leaves, treedef = jax.tree.flatten(template)
    out = []
    for i, t in enumerate(leaves):
        key = f"{prefix}_{i}"
        if key not in arrays:
            raise ValueError(f"{path}: missing {key} (the run's model or optimizer differs)")
        a = arrays[key]
        if a.shape != tuple(t.shape) or a.dtype != np.dtype(t.dtype):
            raise ValueError(f"{path}: {key} is {a.dtype}{list(a.shape)}, expected {np.dtype(t.dtype)}{list(t.shape)}")
        out.append(jnp.asarray(a))
    if f"{prefix}_{len(leaves)}" in arrays:
        raise ValueError(f"{path}: more {prefix} arrays than the run's state has")
    return jax.tree.unflatten(treedef, out)


def load_state(out_dir: str | os.PathLike, template: TrainState, prefix: str = "") -> TrainState:
    """The saved state, shaped like ``template`` (a fresh ``Trainer.init_state()``)."""
    path = os.path.join(os.fspath(out_dir), prefix + STATE_FILE)
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    return TrainState(_fill(template.master, arrays, "master", path),
                      _fill(template.opt_state, arrays, "opt", path), int(arrays["step"]))
