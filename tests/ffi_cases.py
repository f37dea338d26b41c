"""Random operands for the kernels_ascend FFI tests (shared by the op, sharding and bench runs)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def attention_case(rng, T: int, H: int, A: int, widths: tuple[int, ...], rows: tuple[int, ...]):
    """q, pools, idxs (about 1 in 8 entries -1), sink for ``sparse_attention``."""
    q = jnp.asarray(rng.standard_normal((T, H, A)), jnp.bfloat16)
    pools = tuple(jnp.asarray(rng.standard_normal((n, A)), jnp.bfloat16) for n in rows)
    idxs = tuple(jnp.asarray(np.where(rng.random((T, w)) < 0.125, -1, rng.integers(0, n, (T, w))), jnp.int32)
                 for w, n in zip(widths, rows))
    sink = jnp.asarray(rng.standard_normal(H), jnp.float32)
    return q, pools, idxs, sink


def indexer_case(rng, T: int, I: int, N: int, J: int):
    """q, k, w, n_visible (0, partial and full rows) for ``indexer_scores``."""
    q = jnp.asarray(rng.standard_normal((T, I, J)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((T, N, J)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((T, I)) * 0.5, jnp.float32)
    n_vis = rng.integers(0, N + 1, T)
    n_vis[-1] = N
    return q, k, w, jnp.asarray(n_vis, jnp.int32)


def pool_case(rng, T: int, I: int, P: int, R: int, N: int, J: int):
    """q, pool, entry, token_row, w, n_visible for ``indexer_scores_pool``."""
    q = jnp.asarray(rng.standard_normal((T, I, J)), jnp.bfloat16)
    pool = jnp.asarray(rng.standard_normal((P, J)), jnp.bfloat16)
    entry = jnp.asarray(rng.integers(0, P, (R, N)), jnp.int32)
    row = jnp.asarray(rng.integers(0, R, T), jnp.int32)
    w = jnp.asarray(rng.standard_normal((T, I)) * 0.5, jnp.float32)
    n_vis = jnp.asarray(rng.integers(1, N + 1, T), jnp.int32)
    return q, pool, entry, row, w, n_vis


def expert_weights(rng, fmt: str, E: int, out: int, inp: int):
    """Stacked expert weights ``(values, scale or None)`` in storage format ``fmt``."""
    if fmt == "fp8":
        v = np.clip(rng.standard_normal((E, out, inp)) * 100, -448, 448)
        s = rng.integers(118, 124, (E, -(-out // 32), -(-inp // 32)))
        return jnp.asarray(v, jnp.float32).astype(jnp.float8_e4m3fn), jnp.asarray(s, jnp.uint8)
    if fmt == "fp4":
        return (jnp.asarray(rng.integers(0, 256, (E, out, inp // 2)), jnp.uint8),
                jnp.asarray(rng.integers(120, 126, (E, out, inp // 32)), jnp.uint8))
    return jnp.asarray(rng.standard_normal((E, out, inp)) * 0.1, jnp.bfloat16), None


def moe_case(rng, fmt: str, T: int, X: int, D: int, F: int, E: int):
    """x, idx (with out-of-range ids -1 and E), routing weights, w1, w2, w3 for ``moe_experts``."""
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.bfloat16)
    idx = jnp.asarray(rng.integers(-1, E + 1, (T, X)), jnp.int32)
    g = jnp.asarray(rng.random((T, X)), jnp.float32)
    return (x, idx, g, expert_weights(rng, fmt, E, F, D), expert_weights(rng, fmt, E, D, F),
            expert_weights(rng, fmt, E, F, D))
