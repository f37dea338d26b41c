"""Device cache state of the model, as one pytree the jitted step donates.

* ``window[l]``: per backbone layer, ring of W latents per sliding-window slot ``[S, W, A]``
  (position p in ring slot p % W), fp8-QDQ'd bf16 values.
* ``CacheConfig.kv_cache_dtype="packed"`` stores the window rings and ``comp_kv`` as codes
  (``base/kv_codes.py``): ``window[l]`` e4m3 ``[S, W, A]`` with ``window_scale[l]`` ``[S, W, A/32]``
  ue8m0 bytes, ``comp_kv[i]`` two e2m1 a byte ``[B, P, A/2]`` with ``comp_kv_scale[i]``
  ``[B, P, A/16]`` e4m3: 528 and 288 bytes an entry at A = 512 instead of 1024, the same values
  bit for bit (``window_entries`` / ``comp_entries`` decode them). With ``"bf16"`` (default) the
  two scale fields are empty. Like fp8 index keys, a capacity option, not a speed one: the GPU
  attention kernel decodes the codes in registers, off its pipelined row-copy path, and was
  slower on them than on bf16 (``benchmarks/results/device_check_H100_2026-12-06/``).
* ``comp_kv[i]`` / ``index_k[i]``: per KV-source layer ``kv_source_layer_ids[i]`` with ratio r,
  paged ``[B, P, A]`` / ``[B, P, J]`` with ``P = block_tokens // r`` compressed entries per block.
  ``CacheConfig.index_key_dtype``: ``"bf16"`` (default) stores the fp4-QDQ'd keys as bf16 and
  ``index_k_scale`` is empty; ``"fp8"`` stores e5m2 codes and ``index_k_scale[i]`` ``[B, P]`` f32,
  one power-of-two scale per key (``quant.pack_index_keys``: the same keys exactly, 132 instead of
  256 bytes a key at J = 128; scores and outputs are bit-identical). ``index_keys(cache, i)``
  gives the keys as bf16 either way. Measured on an H200 (``kernel_bench/indexer_topk.py``):
  the Triton scoring kernel is not faster on codes (it converts them in registers, which keeps
  the key loads off the pipelined shared-memory path) and prefill scoring of one request row is
  ~25% slower, so fp8 is the capacity option, not the speed one.
* ``comp_state_kv[i]`` / ``comp_state_score[i]``: the compressor's pending group per slot, a ring
  of each slot's last ``M = max(r, spec_tokens + 1)`` positions (position p at p % M), fp32
  ``[S, M, A]`` (unused for r = 1 sources, kept ``[S, 1, A]`` for a uniform pytree). M > r lets
  ``cache_undo`` restore a verification row's rejected positions without touching the accepted
  ones (``CacheConfig.spec_tokens``: the most drafts such a row carries).
* ``dspark_window[k]``: per DSpark stage, ring of ``kv(main_x)`` per slot ``[S, W, A]``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from deepinfer_jax.base import kv_codes, quant
from deepinfer_jax.base.block_size import block_tokens_problem, block_tokens_unit, default_block_tokens  # noqa: F401


INDEX_KEY_DTYPES = quant.INDEX_KEY_DTYPES
KV_CACHE_DTYPES = kv_codes.KV_CACHE_DTYPES


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    num_slots: int = 8          # sliding-window slots (max concurrent requests)
    num_blocks: int = 64        # paged blocks of the compressed caches
    block_tokens: int = 64      # positions per block: a multiple of every ratio and candidate block
    max_blocks_per_seq: int = 16
    index_key_dtype: str = "bf16"  # "bf16" | "fp8" (e5m2 codes + a scale per key; see the module doc)
    kv_cache_dtype: str = "bf16"   # "bf16" | "packed" (window fp8 and compressed fp4 codes; see the module doc)
    spec_tokens: int = 0        # most drafts a verification row carries (sizes the compressor state ring)

    def validate(self, cfg) -> "CacheConfig":
        for f in ("num_slots", "num_blocks", "block_tokens", "max_blocks_per_seq"):
            if getattr(self, f) < 1:
                raise ValueError(f"CacheConfig.{f}={getattr(self, f)!r}: must be >= 1")
        if self.spec_tokens < 0:
            raise ValueError(f"CacheConfig.spec_tokens={self.spec_tokens!r}: must be >= 0")
        if self.spec_tokens + 1 > cfg.sliding_window:
            raise ValueError(f"CacheConfig.spec_tokens={self.spec_tokens!r}: a verification row of "
                             f"spec_tokens + 1 positions must fit the sliding window ({cfg.sliding_window})")
        if self.index_key_dtype not in INDEX_KEY_DTYPES:
            raise ValueError(f"CacheConfig.index_key_dtype={self.index_key_dtype!r}: expected one of {INDEX_KEY_DTYPES}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"CacheConfig.kv_cache_dtype={self.kv_cache_dtype!r}: expected one of {KV_CACHE_DTYPES}")
        if self.kv_cache_dtype == "packed" and cfg.head_dim % kv_codes.WINDOW_BLOCK:
            raise ValueError(f"CacheConfig.kv_cache_dtype='packed': head_dim {cfg.head_dim} is not a multiple of "
                             f"{kv_codes.WINDOW_BLOCK} (the fp8 scale block)")
        problem = block_tokens_problem(cfg, self.block_tokens)
        if problem:
            raise ValueError(f"CacheConfig.block_tokens={self.block_tokens}: {problem}")
        return self

    @property
    def max_model_len(self) -> int:
        return self.block_tokens * self.max_blocks_per_seq

    def state_positions(self, ratio: int) -> int:
        """M: positions per slot of a ratio-``ratio`` source's compressor state ring."""
        return max(ratio, self.spec_tokens + 1) if ratio > 1 else 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ModelCache:
    window: tuple
    comp_kv: tuple
    index_k: tuple
    index_k_scale: tuple
    comp_state_kv: tuple
    comp_state_score: tuple
    dspark_window: tuple
    window_scale: tuple = ()   # packed caches only (see the module doc)
    comp_kv_scale: tuple = ()

    @property
    def packed(self) -> bool:
        return bool(self.window_scale)

    def window_pool(self, layer: int):
        """Layer ``layer``'s window ring as stored: ``[S, W, A]`` bf16 or a ``PackedPool``."""
        if not self.packed:
            return self.window[layer]
        return kv_codes.PackedPool(self.window[layer], self.window_scale[layer])

    def comp_pool(self, i: int):
        """KV source ``i``'s compressed entries as stored: ``[B, P, A]`` bf16 or a ``PackedPool``."""
        if not self.packed:
            return self.comp_kv[i]
        return kv_codes.PackedPool(self.comp_kv[i], self.comp_kv_scale[i])


def cache_block_tokens(cache: ModelCache, cfg) -> int:
    """Positions per paged block, read from the cache's shapes (1 when there are no KV sources)."""
    if not cfg.kv_source_layer_ids:
        return 1
    return cache.comp_kv[0].shape[1] * cfg.compress_ratios[cfg.kv_source_layer_ids[0]]


def window_entries(cache: ModelCache, layer: int) -> jax.Array:
    """Layer ``layer``'s window ring ``[S, W, A]`` as bf16 (decoded when packed)."""
    return kv_codes.unpack(cache.window_pool(layer))


def comp_entries(cache: ModelCache, i: int) -> jax.Array:
    """KV source ``i``'s compressed entries ``[B, P, A]`` as bf16 (decoded when packed)."""
    return kv_codes.unpack(cache.comp_pool(i))


def index_keys(cache: ModelCache, i: int) -> jax.Array:
    """KV source ``i``'s index keys ``[B, P, J]`` as bf16 (decoded when stored as codes)."""
    if not cache.index_k_scale:
        return cache.index_k[i]
    return quant.unpack_index_keys(cache.index_k[i], cache.index_k_scale[i])


def allocate_cache(cfg, cc: CacheConfig) -> ModelCache:
    cc.validate(cfg)
    S, W, A, J = cc.num_slots, cfg.sliding_window, cfg.head_dim, cfg.index_head_dim
    packed = cc.kv_cache_dtype == "packed"
    L = cfg.num_hidden_layers
    if packed:  # zero codes decode to 0.0 whatever the scale; scale bytes 127 / e4m3 1.0 keep them finite
        window = tuple(jnp.zeros((S, W, A), jnp.float8_e4m3fn) for _ in range(L))
        window_s = tuple(jnp.full((S, W, A // kv_codes.WINDOW_BLOCK), 127, jnp.uint8) for _ in range(L))
    else:
        window, window_s = tuple(jnp.zeros((S, W, A), jnp.bfloat16) for _ in range(L)), ()
    comp_kv, comp_s, index_k, index_s, st_kv, st_sc = [], [], [], [], [], []
    for src in cfg.kv_source_layer_ids:
        r = cfg.compress_ratios[src]
        P = cc.block_tokens // r
        if packed:
            comp_kv.append(jnp.zeros((cc.num_blocks, P, A // 2), jnp.uint8))
            comp_s.append(jnp.ones((cc.num_blocks, P, A // kv_codes.COMP_BLOCK), jnp.float8_e4m3fn))
        else:
            comp_kv.append(jnp.zeros((cc.num_blocks, P, A), jnp.bfloat16))
        coded = cc.index_key_dtype == "fp8"
        index_k.append(jnp.zeros((cc.num_blocks, P, J), quant.INDEX_KEY_DTYPE if coded else jnp.bfloat16))
        if coded:
            index_s.append(jnp.ones((cc.num_blocks, P), jnp.float32))
        M = cc.state_positions(r)
        st_kv.append(jnp.zeros((S, M, A), jnp.float32))
        st_sc.append(jnp.full((S, M, A), -jnp.inf, jnp.float32))
    n_stages = cfg.num_nextn_predict_layers if cfg.dspark_enabled else 0
    dspark = tuple(jnp.zeros((S, W, A), jnp.bfloat16) for _ in range(n_stages))
    return ModelCache(window=window, comp_kv=tuple(comp_kv), index_k=tuple(index_k), index_k_scale=tuple(index_s),
                      comp_state_kv=tuple(st_kv), comp_state_score=tuple(st_sc), dspark_window=dspark,
                      window_scale=window_s, comp_kv_scale=tuple(comp_s))
