"""Which weights train, and the fp32 master copy of them.

Trained: every floating-point parameter except the ones the loss cannot or should not move:

* ``mtp.*``: the DSpark stages do not feed the next-token logits (``is_stage_trainable`` picks
  them for their own run, ``dspark_step.DSparkTrainer``, on the frozen backbone).
* ``engram.embed.scale``: the Engram tables' per-row ue8m0 exponents (integers): frozen at their
  init values, so a row's 32-channel blocks keep their dynamic range.
* other fp8 / integer storage (quantized weights): not trained in place (training runs on bf16
  storage; the export quantizes).

Two kinds train without the next-token loss's gradient: ``ffn.gate.bias`` only chooses experts
(zero gradient, so AdamW leaves it) and moves by the load-balancing rule
(``routing_balance.py``); ``attn.indexer.*`` outputs top-k indices only and learns from its own
KL objective (``indexer_loss.py``).

Engram tables (``engram.embed.weight``, always fp8 e4m3 codes, any weight_dtype) ARE trained: they
are the n-gram embeddings, the point of the layer; a frozen random table would only add noise. The
fp32 master holds the codes (the row's value / its frozen scale); the forward uses them rounded to
e4m3 (``table_codes``) with a straight-through gradient, so the forward is the fp8 storage's
exactly, while updates smaller than an e4m3 step accumulate in the master.

The master weights are fp32; ``compute_state`` casts them to the model's parameter dtypes (bf16
for a bf16-storage model) inside the loss, so the forward computes as inference does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

FROZEN_PARTS = ("mtp.",)
# the stages' run: no loss moves their gate biases (no balancing rule runs there) or indexers
STAGE_FROZEN_PARTS = ("ffn.gate.bias", "attn.indexer.")
ENGRAM_TABLE = "engram.embed.weight"
_TRAINED_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(np.float32), np.dtype(np.float16))
_E4M3 = np.dtype(jnp.float8_e4m3fn)


def path_name(path) -> str:
    return ".".join(str(p) for p in path)


def is_trainable(path, value) -> bool:
    name = path_name(path)
    dt = np.dtype(value.dtype) if hasattr(value, "dtype") else None
    if dt is None:
        return False
    if name.endswith(ENGRAM_TABLE) and dt == _E4M3:
        return True
    if dt not in _TRAINED_DTYPES:
        return False
    return not any(part in name + "." for part in FROZEN_PARTS)


def is_stage_trainable(path, value) -> bool:
    """The DSpark stages' run: the floating-point ``mtp.*`` weights, less the parts no loss
    moves (``ffn.gate.bias``, ``attn.indexer.*``); the backbone (embed and head included, which
    the draft shares) stays frozen."""
    name = path_name(path)
    dt = np.dtype(value.dtype) if hasattr(value, "dtype") else None
    if dt is None or dt not in _TRAINED_DTYPES or not name.startswith("mtp."):
        return False
    return not any(part in name + "." for part in STAGE_FROZEN_PARTS)


def split_model(model, trainable=is_trainable):
    """``(graphdef, trainable state in the model's dtypes, frozen state)``; ``trainable(path,
    value) -> bool`` picks the trained weights (default: the backbone run's)."""
    return nnx.split(model, trainable, ...)


def to_master(trainable):
    """fp32 copy of the trainable state."""
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), trainable)


def table_codes(m):
    """fp32 master codes -> the nearest e4m3 codes, as f32 (exact), clipped to e4m3's +-448
    first (the cast has no infinity)."""
    return jnp.clip(m, -448.0, 448.0).astype(jnp.float8_e4m3fn).astype(jnp.float32)


def _compute(m, x):
    if np.dtype(x.dtype) == _E4M3:
        # straight through: the value is the rounded codes (added to an exact 0, so bit for bit),
        # the gradient is the identity's
        return jax.lax.stop_gradient(table_codes(m)) + (m - jax.lax.stop_gradient(m))
    return m.astype(x.dtype)


def compute_state(master, like):
    """The master weights as the loss uses them: cast to the dtypes of ``like`` (the trainable state
    as the model holds it), except the fp8 Engram tables: their e4m3-rounded codes in f32, with a
    straight-through gradient (an fp8 array would carry an fp8 cotangent)."""
    return jax.tree.map(_compute, master, like)


def storage_state(master, like):
    """The master weights in the model's storage dtypes (fp8 tables: the codes ``compute_state``
    uses, so the stored model computes the same logits)."""
    return jax.tree.map(lambda m, x: (table_codes(m) if np.dtype(x.dtype) == _E4M3 else m).astype(x.dtype),
                        master, like)


def decay_mask(master):
    """Weight decay on matrices only (not on norms, mixes, sinks)."""
    return jax.tree.map(lambda x: x.ndim >= 2, master)
