"""Pieces both Hopper MoE grouped-matmul kernels use (``moe_gmm.py`` and its native-fp8 twin
``moe_gmm_fp8mma.py``): the SM count of the grid, the bf16 tile store and the SwiGLU epilogue
with the reference's rounding."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

try:  # Mosaic GPU ships with jax; keep the module importable anywhere (the ops hook imports us)
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu
except Exception:  # pragma: no cover - CPU-only builds without the GPU Pallas backend
    pl = plgpu = None

HOPPER_NUM_SMS = 132  # H100/H200 SXM


def num_sms(interpret: bool) -> int:
    """SMs of the device (2 in interpret mode: a small persistent grid still loops over tiles)."""
    if interpret:
        return 2
    try:
        return int(jax.devices()[0].core_count)
    except Exception:
        return HOPPER_NUM_SMS


def store_tile(out, o_gmem, row0, col0) -> None:
    """A bf16 ``[bm, bn]`` register tile -> ``o_gmem[row0:row0+bm, col0:col0+bn]``, through
    shared memory and one TMA store (waited for before the scratch is released)."""
    bm, bn = out.shape

    @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((bm, bn), jnp.bfloat16))
    def _store(o_smem):
        o_smem[...] = out
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[pl.ds(row0, bm), pl.ds(col0, bn)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def swiglu_epilogue(gate_acc, up_acc, rw, limit: float):
    """The reference's rounding: gate/up rounded to bf16 (its grouped matmuls return bf16),
    clamped SwiGLU and the routing weight in fp32, then bf16."""
    gate = gate_acc.astype(jnp.bfloat16).astype(jnp.float32)
    up = up_acc.astype(jnp.bfloat16).astype(jnp.float32)
    if limit > 0:
        up = jnp.minimum(jnp.maximum(up, -limit), limit)
        gate = jnp.minimum(gate, limit)
    h = gate * jax.nn.sigmoid(gate) * up * rw[:, None]
    return h.astype(jnp.bfloat16)
