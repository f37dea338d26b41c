"""Engram, device half: fetch n-gram rows by hash id, project to keys and a value, gate into the
stream. Hash ids are computed on the host (``runner/engram_hash.py``) and arrive with the batch.

Table rows are fp8 e4m3 with one ue8m0 scale per 32 channels of a row. For each token:
``e = concat(rows)``; ``[keys (C x D), value (D)] = wkv(e)``; per copy c:
``d = (X_c . (q_w * k_w)_c . key_c) * rsqrt(ms(X_c)) * rsqrt(ms(key_c)) / sqrt(D)``,
``gate = sigmoid(sign(d) sqrt(max(|d|, 1e-6)))`` and ``X_c += gate * value``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from deepinfer_jax.base import batch_invariant as bi
from deepinfer_jax.base import quant
from deepinfer_jax.layers.linear import Linear
from deepinfer_jax.sharding import manual
from deepinfer_jax.sharding.partition import split_axes


class EngramTable(nnx.Module):
    def __init__(self, rows: int, head_dim: int):
        self.rows = rows  # the whole table's; inside the attention-DP step a device holds a slice
        self.weight = nnx.Param(jnp.zeros((rows, head_dim), jnp.float8_e4m3fn), logical_axes=("table_rows", None))
        self.scale = nnx.Param(jnp.full((rows, head_dim // 32), 127, jnp.uint8), logical_axes=("table_rows", None))

    def __call__(self, ids: jax.Array) -> jax.Array:
        w, sc = self.weight[...], self.scale[...]
        if w.shape[0] < self.rows:  # rows split over the devices (shard_map): exchange lookups
            axes = split_axes("table_rows", jax.sharding.get_abstract_mesh(), self.rows)
            v, s = manual.gather_rows(w, ids, axes), manual.gather_rows(sc, ids, axes)
        else:
            v, s = jnp.take(w, ids, axis=0), jnp.take(sc, ids, axis=0)
        v = v.astype(jnp.float32)
        s = quant.e8m0_to_f32(s)
        v = v.reshape(*v.shape[:-1], s.shape[-1], 32) * s[..., None]
        return v.reshape(*ids.shape, -1).astype(jnp.bfloat16)


class Engram(nnx.Module):
    def __init__(self, cfg, rows: int, dense_fmt: str):
        D, C = cfg.hidden_size, cfg.hc_mult
        self.dim, self.hc, self.eps = D, C, cfg.rms_norm_eps
        self.embed = EngramTable(rows, cfg.engram_head_dim)
        self.wkv = Linear(cfg.engram_n_hash_cols * cfg.engram_head_dim, D * (C + 1), dense_fmt)
        self.q_weight = nnx.Param(jnp.ones((C, D), jnp.bfloat16), logical_axes=(None, None))
        self.k_weight = nnx.Param(jnp.ones((C, D), jnp.bfloat16), logical_axes=(None, None))

    def __call__(self, x_TCD: jax.Array, hash_ids_TH: jax.Array, live_T: jax.Array | None = None) -> jax.Array:
        e = self.embed(hash_ids_TH)  # [T, cols, hd]
        kv = self.wkv(e.reshape(e.shape[0], -1))
        D, C = self.dim, self.hc
        key = kv[:, : C * D].astype(jnp.float32).reshape(-1, C, D)
        value = kv[:, C * D:].astype(jnp.float32)
        w = self.q_weight[...].astype(jnp.float32) * self.k_weight[...].astype(jnp.float32)
        h = x_TCD.astype(jnp.float32)
        eps = jnp.float32(self.eps)
        rstd = jax.lax.rsqrt(bi.row_mean(h * h, -1) + eps) * jax.lax.rsqrt(bi.row_mean(key * key, -1) + eps)
        dot = bi.row_sum(h * w * key, -1) * rstd * jnp.float32(D ** -0.5)
        gate = jax.nn.sigmoid(jnp.where(jnp.signbit(dot), -1.0, 1.0) * jnp.sqrt(jnp.maximum(jnp.abs(dot), 1e-6)))
        if live_T is not None:
            gate = jnp.where(live_T[:, None], gate, 0)
        return (h + gate[..., None] * value[:, None, :]).astype(x_TCD.dtype)
