"""Rotary embedding on the last ``rope_dim`` channels, adjacent pairs taken as complex numbers.

Frequencies follow the reference in fp32: ``1 / base^(2i/d)``, with the YaRN ramp when
``original_max_position_embeddings > 0`` (compressed layers), none for ratio-0 layers. Angles are
``fp32(position) * freq`` computed on the fly, so there is no table bounded by a max length.
"""

from __future__ import annotations

import math
from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np


@lru_cache(maxsize=16)
def rope_freqs(rope_dim: int, base: float, yarn_factor: float, beta_fast: float, beta_slow: float,
               original_max_pos: int) -> np.ndarray:
    """fp32 [rope_dim/2] inverse frequencies (reference ``precompute_freqs_cis``)."""
    freqs = (np.float32(1.0) / (np.float32(base) ** (np.arange(0, rope_dim, 2, dtype=np.float32)
                                                     / np.float32(rope_dim)))).astype(np.float32)
    if original_max_pos > 0:
        def corrected_dim(rotations: float) -> float:
            return rope_dim * math.log(original_max_pos / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corrected_dim(beta_fast)), 0)
        high = min(math.ceil(corrected_dim(beta_slow)), rope_dim - 1)
        ramp = np.clip((np.arange(rope_dim // 2, dtype=np.float32) - np.float32(low))
                       / np.float32(max(high - low, 1e-3)), 0, 1).astype(np.float32)
        smooth = np.float32(1) - ramp
        freqs = (freqs / np.float32(yarn_factor) * (np.float32(1) - smooth) + freqs * smooth).astype(np.float32)
    return freqs


def layer_rope_freqs(cfg, layer: int) -> np.ndarray:
    """Ratio-0 layers: ``rope_theta``, no YaRN. Compressed layers: ``compress_rope_theta`` + YaRN."""
    if cfg.compress_ratios[layer]:
        return rope_freqs(cfg.qk_rope_head_dim, cfg.compress_rope_theta, cfg.yarn_factor,
                          cfg.yarn_beta_fast, cfg.yarn_beta_slow, cfg.yarn_original_max_position_embeddings)
    return rope_freqs(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.yarn_factor, cfg.yarn_beta_fast,
                      cfg.yarn_beta_slow, 0)


def apply_rope(x: jax.Array, positions: jax.Array, freqs, inverse: bool = False) -> jax.Array:
    """Rotate the last ``2*len(freqs)`` channels of ``x [..., A]`` (or ``[..., heads, A]`` with
    ``positions`` broadcasting over heads) at ``positions``; result in ``x.dtype``."""
    freqs = np.asarray(freqs, np.float32)
    rd = 2 * freqs.shape[0]
    ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(freqs)  # [..., rd/2]
    while ang.ndim < x.ndim:
        ang = ang[..., None, :]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    if inverse:
        sin = -sin
    tail = x[..., -rd:].astype(jnp.float32).reshape(*x.shape[:-1], rd // 2, 2)
    re, im = tail[..., 0], tail[..., 1]
    rot = jnp.stack([re * cos - im * sin, re * sin + im * cos], axis=-1).reshape(*x.shape[:-1], rd)
    return jnp.concatenate([x[..., :-rd], rot.astype(x.dtype)], axis=-1)
