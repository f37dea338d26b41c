"""A per-GPU slice of DeepSeek-V4.1-Flash for benchmarks (``scripts/bench_e2e.py``,
``scripts/bench_spec.py --slice``): Flash's widths (or the tiny model's), a chosen layer
schedule and a few local routed experts, so one device runs the step a rank of the released
deployment runs, with random weights (``models/random_weights.py``)."""

from __future__ import annotations

import dataclasses

__all__ = ["SCHEDULE", "DEPTHS", "slice_config"]

# the fields that make up a layer schedule (taken whole from one preset)
SCHEDULE = ("num_hidden_layers", "num_nextn_predict_layers", "compress_ratios", "kv_source_layer_ids",
            "index_source_layer_ids", "candidate_source_layer_id", "engram_layer_ids", "dspark_target_layer_ids")
DEPTHS = ("tiny", "full")


def slice_config(small: bool, experts: int, context: int, depth: str = "tiny"):
    """Widths: V4.1-Flash's (or the tiny model's with ``small``). Layer schedule: the tiny model's
    6 + 2 layers (``depth="tiny"``) or the released 40 + 3 (``"full"``). ``experts``: local
    routed experts per layer (Flash widths only); ``context``: the longest position needed."""
    from deepinfer_jax.config import preset

    if depth not in DEPTHS:
        raise ValueError(f"slice_config: depth={depth!r}: expected one of {DEPTHS}")
    tiny, flash = preset("v41-tiny"), preset("v41-flash")
    schedule = {k: getattr(flash if depth == "full" else tiny, k) for k in SCHEDULE}
    if small:
        return tiny.replace(max_position_embeddings=max(tiny.max_position_embeddings, context), **schedule)
    if isinstance(experts, bool) or not isinstance(experts, int) or experts < 1:
        raise ValueError(f"slice_config: experts={experts!r}: must be an int >= 1")
    keep = {f.name: getattr(flash, f.name) for f in dataclasses.fields(flash)}
    keep.update(schedule)
    keep.update(n_routed_experts=experts, num_experts_per_tok=min(flash.num_experts_per_tok, experts),
                dspark_n_routed_experts=experts, dspark_num_experts_per_tok=min(3, experts),
                engram_vocab_size=50_000, max_position_embeddings=max(context, 65536))
    return type(flash)(**keep).validate()
