"""The paged caches' block size rule: which ``block_tokens`` a model's caches accept, and the
default the engine derives (a function of the model config alone, so the engine config and the
cache both check it without importing each other)."""

from __future__ import annotations

import math


def block_tokens_unit(cfg) -> int:
    """The smallest block size the caches accept for ``cfg``; every valid ``block_tokens`` is a
    multiple of it. A block of a ratio-r KV source holds ``block_tokens // r`` whole compressed
    entries, and the candidate source's entries per block are whole candidate blocks."""
    unit = 1
    for r in set(cfg.compress_ratios):
        if r:
            unit = math.lcm(unit, r)
    if cfg.candidate_source_layer_id >= 0:
        unit = math.lcm(unit, cfg.compress_ratios[cfg.candidate_source_layer_id] * cfg.candidate_block_size)
    return unit


def block_tokens_problem(cfg, block_tokens: int) -> str | None:
    """Why ``block_tokens`` does not fit ``cfg`` (None when it does), with the nearest sizes that fit."""
    unit = block_tokens_unit(cfg)
    if block_tokens % unit == 0:
        return None
    lo, hi = block_tokens // unit * unit, -(-block_tokens // unit) * unit
    nearest = f"{lo} or {hi}" if lo else f"{hi}"
    why = f"every compress ratio {sorted(set(cfg.compress_ratios) - {0})}"
    if cfg.candidate_source_layer_id >= 0:
        r = cfg.compress_ratios[cfg.candidate_source_layer_id]
        why += f" and ratio {r} x candidate_block_size {cfg.candidate_block_size}"
    return f"must be a multiple of {unit} ({why} divide a block); nearest that fit: {nearest}"


def default_block_tokens(cfg, target: int = 64) -> int:
    """The multiple of ``block_tokens_unit(cfg)`` nearest ``target`` positions (ties: the smaller;
    never below one unit): 64 for the released model, 60 with candidate blocks of 5 at ratio 1."""
    unit = block_tokens_unit(cfg)
    lo = target // unit * unit
    return lo if lo and target - lo <= unit // 2 else lo + unit
