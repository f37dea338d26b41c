"""``ragged_all_to_all`` with the semantics of ``jax.lax.ragged_all_to_all``, on every backend.

Inside ``shard_map`` over ``axis_name`` (``n`` devices), device ``i`` sends rows
``operand[input_offsets[j] : input_offsets[j] + send_sizes[j]]`` to device ``j``, where they land at
``output[output_offsets[j] : ...]`` of device ``j`` (``output_offsets`` are the *receiver's*
offsets, as the primitive defines them); ``recv_sizes[j]`` is how many rows device ``j`` sends
here. Rows of ``output`` nobody writes keep their value.

GPUs and TPUs run XLA's ``ragged-all-to-all``. XLA:CPU has no emitter for that opcode, so on CPU
(tests on forced host devices) the same result comes from a dense ``all_to_all`` of every
device's chunks padded to the operand's row count: ``n`` times the bytes, identical rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def native_supported(platform: str) -> bool:
    """Whether XLA on ``platform`` emits ``ragged-all-to-all`` (CPU does not)."""
    return platform in ("gpu", "cuda", "rocm", "tpu")


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                      axis_name, native: bool):
    """``lax.ragged_all_to_all(...)`` when ``native``, else its dense emulation (see the module
    docstring). Offsets and sizes: int32 ``[n]``."""
    if native:
        return lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                     axis_name=axis_name)
    rows = operand.shape[0]
    n = send_sizes.shape[0]
    j = jnp.arange(rows, dtype=jnp.int32)[None, :]                      # [1, rows]
    src = jnp.clip(input_offsets[:, None] + j, 0, rows - 1)             # [n, rows]
    keep = (j < send_sizes[:, None]).reshape((n, rows) + (1,) * (operand.ndim - 1))
    packed = jnp.where(keep, operand[src], jnp.zeros((), operand.dtype))  # [n, rows, ...] chunk per receiver
    got = lax.all_to_all(packed, axis_name, 0, 0)                        # [n, rows, ...] chunk per sender
    # each sender's offset into this device's output travels with its chunk
    off = lax.all_to_all(output_offsets.reshape(n, 1), axis_name, 0, 0).reshape(n)
    dest = jnp.where(j < recv_sizes[:, None], off[:, None] + j, output.shape[0])  # out of range: dropped
    return output.at[dest.reshape(-1)].set(got.reshape((n * rows,) + operand.shape[1:]), mode="drop")
