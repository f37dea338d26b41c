"""Random *valid* DeepSeek-V4.1 configurations from a seed, for the generality tests.

``random_config(seed)`` draws a small model (hidden 32-64, a few heads) that exercises the choices
the released config fixes: 3-10 backbone layers in a random layout of ratio 0 / 2 / 1 (and now and
then 4) layers, KV / index / candidate sources, candidate blocks of 3-8, a window of 4-16, the
hyper-connection copies and Sinkhorn iterations, top-1 and top-k MoE with its own DSpark counts, 1-3 DSpark stages with
blocks of 2-5, Engram on or off with 2- to 4-grams, vocabularies that are not multiples of 32, odd
head counts, fp8 and bf16 storage. Every draw follows the rules ``ModelConfig.validate()`` states
(and the result is validated).
"""

from __future__ import annotations

import numpy as np

from deepinfer_jax.config import ModelConfig


def _layout(rng: np.random.Generator, n: int) -> tuple[int, ...]:
    """Backbone compress ratios: runs of one ratio, mostly 0 / 2 / 1, sometimes 4."""
    ratios, r = [], None
    for _ in range(n):
        if r is None or rng.random() < 0.45:
            r = int(rng.choice([0, 2, 1, 4], p=[0.3, 0.3, 0.3, 0.1]))
        ratios.append(r)
    return tuple(ratios)


def _kv_sources(rng, ratios) -> tuple[int, ...]:
    """A compressed layer reads the latest source at or before it, which must share its ratio: a
    ratio change opens a new source; a run may open more."""
    srcs, cur = [], 0
    for i, r in enumerate(ratios):
        if r == 0:
            continue
        if cur != r or rng.random() < 0.25:
            srcs.append(i)
            cur = r
    return tuple(srcs)


def _candidate_source(rng, cfg_kw, ratios, kv, idx) -> int:
    """An index source after which every index source reads the same KV source (or -1)."""
    def src_of(i):
        return max(s for s in kv if s <= i)

    ok = [c for c in idx if all(src_of(i) == src_of(c) for i in idx if i > c)]
    if not ok or rng.random() < 0.25:
        return -1
    return int(rng.choice(ok))


def random_config(seed: int) -> ModelConfig:
    rng = np.random.default_rng(seed)
    pick = lambda xs: xs[int(rng.integers(len(xs)))]  # noqa: E731

    fp8 = rng.random() < 0.5
    n = int(rng.integers(3, 11))
    n_stages = int(rng.integers(1, 4))
    ratios = _layout(rng, n)
    kv = _kv_sources(rng, ratios)
    extra_idx = [i for i, r in enumerate(ratios) if r and i not in kv and rng.random() < 0.35]
    idx = tuple(sorted(set(kv) | set(extra_idx)))
    cand = _candidate_source(rng, {}, ratios, kv, idx)

    heads = pick([1, 2, 3, 5])
    o_groups = pick([g for g in (1, 2, 3, 5) if heads % g == 0])
    head_dim = pick([32, 64])
    hidden = pick([32, 64]) if fp8 else pick([32, 40, 48, 64])
    q_lora = pick([32, 64]) if fp8 else pick([24, 32, 40])
    o_rank = pick([r for r in (8, 16, 32) if (o_groups * r) % 32 == 0]) if fp8 else pick([8, 12, 16])
    inter = pick([32, 64]) if fp8 else pick([16, 24, 32])
    vocab = int(rng.integers(40, 300))
    while vocab % 32 == 0:
        vocab += 1

    n_exp = int(rng.integers(1, 7))
    top_k = 1 if rng.random() < 0.4 else int(rng.integers(1, n_exp + 1))
    d_exp = int(rng.integers(1, 6))
    d_top = 1 if rng.random() < 0.4 else int(rng.integers(1, d_exp + 1))

    engram = rng.random() < 0.6
    e_layers = tuple(sorted(rng.choice(n, size=int(rng.integers(1, min(n, 2) + 1)), replace=False).tolist())) \
        if engram else ()

    targets = tuple(sorted(rng.choice(n, size=int(rng.integers(1, min(n, 3) + 1)), replace=False).tolist()))
    yarn = rng.random() < 0.7
    hc_mult = pick([2, 3, 4, 4])
    cfg = ModelConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=n, num_nextn_predict_layers=n_stages,
        num_attention_heads=heads, head_dim=head_dim, qk_rope_head_dim=pick([8, 16, 32]), q_lora_rank=q_lora,
        o_groups=o_groups, o_lora_rank=o_rank, sliding_window=int(rng.integers(4, 17)),
        swiglu_limit=pick([1.0, 10.0]), max_position_embeddings=512,
        yarn_factor=pick([2.0, 4.0]), yarn_original_max_position_embeddings=pick([16, 32]) if yarn else 0,
        n_routed_experts=n_exp, num_experts_per_tok=top_k, moe_intermediate_size=inter,
        compress_ratios=ratios + (0,) * n_stages, kv_source_layer_ids=kv, index_source_layer_ids=idx,
        index_n_heads=pick([1, 3, 4, 5]), index_head_dim=32, index_topk=int(rng.integers(1, 17)),
        candidate_source_layer_id=cand, candidate_topk_blocks=int(rng.integers(1, 5)),
        candidate_block_size=int(rng.integers(3, 9)),
        hc_mult=hc_mult, hc_sinkhorn_iters=int(rng.integers(1, 21)),
        engram_layer_ids=e_layers, engram_num_embeddings=(1,) * len(e_layers),  # rows: set by the writer
        engram_max_ngram_size=int(rng.integers(2, 5)), engram_vocab_size=int(rng.integers(20, 80)),
        engram_n_heads=int(rng.integers(1, 4)), engram_head_dim=32, engram_pad_token_id=2,
        dspark_block_size=int(rng.integers(2, 6)), dspark_noise_token_id=vocab - 1,
        dspark_target_layer_ids=targets, dspark_markov_rank=pick([8, 16, 32]),
        dspark_n_routed_experts=d_exp, dspark_num_experts_per_tok=d_top,
        weight_dtype="fp8" if fp8 else "bf16",
        expert_dtype=pick(["fp4", "fp8"]) if fp8 else "bf16",
    )
    return cfg.validate()


def describe(cfg: ModelConfig) -> str:
    """One line of what a config exercises (for test ids and failure messages)."""
    return (f"L{cfg.num_hidden_layers} r={''.join(map(str, cfg.compress_ratios[:cfg.num_hidden_layers]))} "
            f"kv={list(cfg.kv_source_layer_ids)} idx={list(cfg.index_source_layer_ids)} "
            f"cand={cfg.candidate_source_layer_id}/{cfg.candidate_block_size} W={cfg.sliding_window} "
            f"H={cfg.num_attention_heads} D={cfg.hidden_size} V={cfg.vocab_size} hc={cfg.hc_mult} "
            f"moe={cfg.num_experts_per_tok}/{cfg.n_routed_experts} dspark={cfg.num_nextn_predict_layers}x"
            f"{cfg.dspark_block_size} engram={list(cfg.engram_layer_ids)}/{cfg.engram_max_ngram_size} "
            f"{cfg.weight_dtype}/{cfg.expert_dtype}")
