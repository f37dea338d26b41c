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


def small_config(tokenizer: str | os.PathLike | None = None) -> ModelConfig:
    """``v41-small``: the shipped model's config, about 40M parameters (8 of them active per
    token) with every layer kind of the released schedule: window-only layer 0, ratio-2 layers 1-3
    (KV and index source 1), ratio-1 layers 4-7 (KV source 4; index sources 4 and 6; candidate
    source 4, so index layer 6 scores only its candidate blocks; layers 5-7 are YOCO decoders),
    index top-k 64 (of up to 1024 positions at the training length), Engram on layers 1 and 3,
    mHC (4 copies, 20 Sinkhorn iterations), 8 routed experts (top 2) plus the shared one, and two
    DSpark stages drafting 5 tokens from target layers 5-7. Context 4096 (trained at 1024).

    ``tokenizer``: a ``tokenizer.json`` or its directory (with ``tokenizer_ids.json``): the vocab
    size, the special ids and the Engram compressed vocabulary come from it; without one, a
    vocab of 8192 with the identity Engram map (tests)."""
    vocab, ids, compressed = 8192, dict(bos_token_id=0, eos_token_id=1, pad_token_id=2,
                                        engram_pad_token_id=2, dspark_noise_token_id=3), None
    if tokenizer is not None:
        path = os.fspath(tokenizer)
        folder = path if os.path.isdir(path) else os.path.dirname(path)
        tok_json = os.path.join(folder, "tokenizer.json") if os.path.isdir(path) else path
        import json

        with open(os.path.join(folder, "tokenizer_ids.json")) as f:
            info = json.load(f)
        vocab = int(info["vocab_size"])
        ids = {k: int(info[k]) for k in ids}
        from deepinfer_jax.base.engram_tables import compressed_token_map

        compressed = compressed_token_map(tok_json)[1]
    e_ids, ngram, heads, evocab = (1, 3), 3, 4, 12000
    return ModelConfig(
        vocab_size=vocab, hidden_size=256, num_hidden_layers=8, num_nextn_predict_layers=2,
        num_attention_heads=8, head_dim=64, qk_rope_head_dim=16, q_lora_rank=128, o_groups=2,
        o_lora_rank=128, sliding_window=128, swiglu_limit=10.0, max_position_embeddings=4096,
        yarn_factor=4.0, yarn_original_max_position_embeddings=1024,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=384,
        compress_ratios=(0, 2, 2, 2, 1, 1, 1, 1, 0, 0), kv_source_layer_ids=(1, 4),
        index_source_layer_ids=(1, 4, 6), index_n_heads=4, index_head_dim=32, index_topk=64,
        candidate_source_layer_id=4, candidate_topk_blocks=32, candidate_block_size=8,
        hc_mult=4, hc_sinkhorn_iters=20,
        engram_layer_ids=e_ids, engram_num_embeddings=engram_table_rows(len(e_ids), ngram, heads, evocab),
        engram_max_ngram_size=ngram, engram_vocab_size=evocab, engram_n_heads=heads, engram_head_dim=32,
        engram_compressed_vocab_size=compressed if compressed is not None else vocab,
        dspark_block_size=5, dspark_target_layer_ids=(5, 6, 7), dspark_markov_rank=64,
        dspark_n_routed_experts=4, dspark_num_experts_per_tok=2,
        weight_dtype="bf16", expert_dtype="bf16", **ids,
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
                 "v41-train-tiny-dspark": _train_tiny_dspark, "v41-small": small_config}


def train_config(name_or_path: str, tokenizer: str | None = None) -> ModelConfig:
    """A preset (training or model preset) or a ``config.json`` file / model directory, switched to
    bf16 storage. ``tokenizer`` goes to presets that take one (``v41-small``)."""
    if name_or_path == "v41-small":
        cfg = small_config(tokenizer)
    elif name_or_path in TRAIN_PRESETS:
        cfg = TRAIN_PRESETS[name_or_path]()
    elif name_or_path in PRESETS:
        cfg = preset(name_or_path)
    elif os.path.exists(name_or_path):
        cfg = ModelConfig.from_json(name_or_path)
    else:
        raise ValueError(f"config={name_or_path!r}: neither a preset ({sorted(TRAIN_PRESETS) + sorted(PRESETS)}) "
                         "nor an existing config.json / model directory")
    return cfg.replace(weight_dtype="bf16", expert_dtype="bf16")
