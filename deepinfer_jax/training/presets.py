"""Model configs to train: a config preset name (``config.PRESETS`` or the training ones here) or
a ``config.json`` path. Training runs on bf16 storage (``weight_dtype = expert_dtype = "bf16"``);
the export quantizes."""

from __future__ import annotations

import os

from deepinfer_jax.base.engram_tables import engram_table_rows
from deepinfer_jax.config import PRESETS, ModelConfig, preset


def _train_tiny() -> ModelConfig:
    """CPU-sized: 4 layers (ratios 0 / 2 / 1 / 0: window-only, ratio-2 and ratio-1 compressed
    KV with their indexers, candidate blocks), mHC, top-2 MoE with a shared expert; no Engram
    (``v41-train-tiny-engram`` has it), no DSpark stages (their training is later)."""
    return ModelConfig(
        vocab_size=67, hidden_size=64, num_hidden_layers=4, num_nextn_predict_layers=0,
        num_attention_heads=2, head_dim=32, qk_rope_head_dim=16, q_lora_rank=32, o_groups=2,
        o_lora_rank=16, sliding_window=8, swiglu_limit=10.0, max_position_embeddings=512,
        yarn_factor=4.0, yarn_original_max_position_embeddings=16,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        compress_ratios=(0, 2, 1, 0), kv_source_layer_ids=(1, 2), index_source_layer_ids=(1, 2),
        index_n_heads=2, index_head_dim=32, index_topk=4,
        candidate_source_layer_id=2, candidate_topk_blocks=2, candidate_block_size=4,
        hc_mult=2, hc_sinkhorn_iters=4, engram_layer_ids=(), engram_num_embeddings=(),
        dspark_block_size=0, dspark_target_layer_ids=(),
        weight_dtype="bf16", expert_dtype="bf16",
    ).validate()


def _train_tiny_engram() -> ModelConfig:
    """``v41-train-tiny`` with Engram on layers 0 and 2: 2- and 3-grams, 2 heads, head_dim 32, a
    small hashed vocabulary (engram_vocab_size 40: tables of a few hundred rows, so a batch hits a
    fraction of them); the identity token map (compressed vocab = vocab_size) unless a tokenizer
    is given."""
    base = _train_tiny()
    ids, ngram, heads, evocab = (0, 2), 3, 2, 40
    return base.replace(
        engram_layer_ids=ids, engram_num_embeddings=engram_table_rows(len(ids), ngram, heads, evocab),
        engram_max_ngram_size=ngram, engram_vocab_size=evocab, engram_n_heads=heads, engram_head_dim=32,
        engram_pad_token_id=2, engram_compressed_vocab_size=base.vocab_size,
    ).validate()


def _train_tiny_dspark() -> ModelConfig:
    """``v41-train-tiny`` with 2 DSpark stages (block 3, context from layers 1..3, Markov rank
    16, top-2 of 4 experts in the stages): a CPU-sized model for the stages' training."""
    return _train_tiny().replace(
        num_nextn_predict_layers=2, compress_ratios=(0, 2, 1, 0, 0, 0), dspark_block_size=3,
        dspark_noise_token_id=66, dspark_target_layer_ids=(1, 2, 3), dspark_markov_rank=16,
        dspark_n_routed_experts=4, dspark_num_experts_per_tok=2,
    ).validate()


TRAIN_PRESETS = {"v41-train-tiny": _train_tiny, "v41-train-tiny-engram": _train_tiny_engram,
                 "v41-train-tiny-dspark": _train_tiny_dspark}


def train_config(name_or_path: str) -> ModelConfig:
    """A preset (training or model preset) or a ``config.json`` file / model directory, switched to
    bf16 storage."""
    if name_or_path in TRAIN_PRESETS:
        cfg = TRAIN_PRESETS[name_or_path]()
    elif name_or_path in PRESETS:
        cfg = preset(name_or_path)
    elif os.path.exists(name_or_path):
        cfg = ModelConfig.from_json(name_or_path)
    else:
        raise ValueError(f"config={name_or_path!r}: neither a preset ({sorted(TRAIN_PRESETS) + sorted(PRESETS)}) "
                         "nor an existing config.json / model directory")
    return cfg.replace(weight_dtype="bf16", expert_dtype="bf16")
