"""``base.at[:R].set(x_R)`` for the step's fixed-size carries, safe inside ``shard_map``.

A step's outputs that the next step reads (sampled ids, the speculation carry) have
``max_num_seqs`` rows; the step fills its first ``R`` (the row bucket). When ``R`` is all of them
the update is skipped: inside ``shard_map`` (the DP step) the Shardy partitioner of jax 0.11.2
crashes (a segmentation fault at compile time) on a dynamic-update-slice covering its whole
operand; ``scripts/repro_shardy_full_update.py`` reproduces it in ten lines (jax 0.12.0.1
compiles it).
"""

from __future__ import annotations

import jax.numpy as jnp


def set_rows(base, x):
    """``base`` with its first ``len(x)`` rows replaced by ``x``."""
    if x.shape == base.shape:
        return x.astype(base.dtype)
    return base.at[:x.shape[0]].set(x)


def pad_rows(x, n: int):
    """``x`` zero-padded to ``n`` rows."""
    return set_rows(jnp.zeros((n,) + x.shape[1:], x.dtype), x)
