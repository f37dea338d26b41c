"""Which weights train, and the fp32 master copy of them.

Trained: every floating-point parameter except the ones the loss cannot or should not move:

* ``ffn.gate.bias``: it only chooses experts (no gradient); DeepSeek adjusts it by a
  load-balancing rule, not by the loss.
* ``attn.indexer.*``: its output is top-k indices only (no gradient, as in the reference); it is
  trained by its own objective (later).
* ``mtp.*``: the DSpark stages do not feed the next-token logits (their training is later).
* fp8 / integer storage (Engram tables, quantized weights): not trained in place.

The master weights are fp32; ``compute_state`` casts them to the model's parameter dtypes (bf16
for a bf16-storage model) inside the loss, so the forward computes as inference does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

FROZEN_PARTS = ("ffn.gate.bias", "attn.indexer.", "mtp.")


def path_name(path) -> str:
    return ".".join(str(p) for p in path)


def is_trainable(path, value) -> bool:
    name = path_name(path)
    dt = np.dtype(value.dtype) if hasattr(value, "dtype") else None
    if dt is None or dt not in (np.dtype(jnp.bfloat16), np.dtype(np.float32), np.dtype(np.float16)):
        return False
    return not any(part in name + "." for part in FROZEN_PARTS)


def split_model(model):
    """``(graphdef, trainable state in the model's dtypes, frozen state)``."""
    return nnx.split(model, is_trainable, ...)


def to_master(trainable):
    """fp32 copy of the trainable state."""
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), trainable)


def compute_state(master, like):
    """The master weights cast to the dtypes of ``like`` (the trainable state as the model holds it)."""
    return jax.tree.map(lambda m, x: m.astype(x.dtype), master, like)


def decay_mask(master):
    """Weight decay on matrices only (not on norms, mixes, sinks)."""
    return jax.tree.map(lambda x: x.ndim >= 2, master)
