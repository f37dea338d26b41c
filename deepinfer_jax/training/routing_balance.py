"""Expert load balancing without an auxiliary loss (DeepSeek-V3's rule, kept by V4.1): the gate's
bias only chooses experts (it has no gradient), and after each step every layer's bias moves by
``rate`` towards balance: up for experts that got fewer tokens than the mean, down for those that
got more (``bias += rate * sign(mean load - load)``).

The loads come from the training forward's ``gate{l}_indices`` taps. The biases live in the fp32
master weights (they train like the others but get a zero gradient, so AdamW leaves them alone)
and this update is applied to them after the optimizer's."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp

_BIAS = re.compile(r"layers\W+(\d+)\W+ffn\W+gate\W+bias")


def expert_loads(cfg, taps: dict) -> dict[int, jax.Array]:
    """``{layer: tokens routed to each expert [E] f32}`` of the backbone layers."""
    out = {}
    for layer in range(cfg.num_hidden_layers):
        idx = taps.get(f"gate{layer}_indices")
        if idx is not None:
            n_e = cfg.moe_experts(layer)[0]
            out[layer] = jnp.zeros((n_e,), jnp.float32).at[idx.reshape(-1)].add(1.0)
    return out


def balance_biases(master, loads: dict, rate: float):
    """``master`` with each backbone layer's gate bias moved towards balance."""
    def upd(path, x):
        m = _BIAS.search(jax.tree_util.keystr(path))
        if m is None or int(m.group(1)) not in loads:
            return x
        load = loads[int(m.group(1))]
        return x + rate * jnp.sign(jnp.mean(load) - load)

    return jax.tree_util.tree_map_with_path(upd, master)


def imbalance(loads: dict) -> jax.Array:
    """Max over layers of (most loaded expert's tokens / mean): 1.0 is perfect balance."""
    if not loads:
        return jnp.float32(1.0)
    return jnp.max(jnp.stack([jnp.max(v) / jnp.maximum(jnp.mean(v), 1e-9) for v in loads.values()]))
