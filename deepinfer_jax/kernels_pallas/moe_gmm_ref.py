"""Pure-jnp reference of the routed-expert FFN (grouped matmul over tokens sorted by expert).

For each (token t, slot x) routed to expert e with weight g:
``y[t,x] = W2_e( QDQ( silu(min(W1_e a, L)) * clip(W3_e a, -L, L) * g ) )`` with
``a = QDQ(x_t)`` when the experts are quantized (fp8 activation QDQ, blocks of 32), and the
products in bf16 with fp32 accumulation, as the reference computes them. Weights come in their
storage format and are dequantized inside the computation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_jax.base import batch_invariant as bi
from deepinfer_jax.base import quant


def dequant_experts(w: jax.Array, scale: jax.Array | None, fmt: str) -> jax.Array:
    """Stacked expert weights ``[E, out, in(/2)]`` -> bf16 ``[E, out, in]``."""
    if fmt == "fp4":
        return quant.dequant_fp4(w, scale)
    if fmt == "fp8":
        return quant.dequant_fp8_block(w, scale)
    return w.astype(jnp.bfloat16)


def _grouped(x_MK: jax.Array, w_EOK: jax.Array, group_sizes_E: jax.Array) -> jax.Array:
    return bi.ragged_dot(x_MK, jnp.swapaxes(w_EOK, 1, 2), group_sizes_E,
                         preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def moe_experts_ref(x_TD: jax.Array, idx_TX: jax.Array, weight_TX: jax.Array,
                    w1, w2, w3, fmt: str, swiglu_limit: float, n_experts: int) -> jax.Array:
    """``w1/w2/w3 = (values, scale or None)`` stacked over experts. Returns bf16 ``[T, X, D]``;
    routing entries with expert id outside ``[0, n_experts)`` contribute zeros."""
    T, X = idx_TX.shape
    quantized = fmt in ("fp4", "fp8")
    a = quant.act_quant_fp8(x_TD.astype(jnp.bfloat16)) if quantized else x_TD.astype(jnp.bfloat16)
    flat_e = idx_TX.reshape(-1)
    in_range = (flat_e >= 0) & (flat_e < n_experts)
    key = jnp.where(in_range, flat_e, n_experts)
    order = jnp.argsort(key, stable=True)
    tok = order // X
    xs = a[tok]
    sizes = jnp.bincount(key, length=n_experts + 1)[:n_experts].astype(jnp.int32)
    W1 = dequant_experts(*w1, fmt)
    W3 = dequant_experts(*w3, fmt)
    W2 = dequant_experts(*w2, fmt)
    gate = _grouped(xs, W1, sizes).astype(jnp.float32)
    up = _grouped(xs, W3, sizes).astype(jnp.float32)
    if swiglu_limit > 0:
        up = jnp.clip(up, -swiglu_limit, swiglu_limit)
        gate = jnp.minimum(gate, swiglu_limit)
    h = jax.nn.silu(gate) * up * weight_TX.reshape(-1)[order][:, None].astype(jnp.float32)
    h = h.astype(jnp.bfloat16)
    if quantized:
        h = quant.act_quant_fp8(h)
    y = _grouped(h, W2, sizes)
    y = jnp.where(in_range[order][:, None], y, 0)
    out = jnp.zeros_like(y).at[order].set(y)
    return out.reshape(T, X, -1)
