#!/usr/bin/env python3
"""Modelled cost of a balanced context-parallel prefill step per device and layer, at
V4.1-Flash's shapes (a model, not a measurement: no multi-GPU run has measured CP yet).

A CP step (``sharding/context_parallel.py``) splits a rank's ``T`` prefill tokens over ``P`` cp
devices (``T / P`` each, mirror layout) and exchanges, per layer:

* the step's window KV (one ``A``-wide latent per token, bf16): an all-gather, ``(P-1)/P * T * A * 2``
  bytes into each device;
* in the KV-source layers with a ratio > 1 compressor, its fp32 projections (kv and score,
  ``2 * T * A * 4``) the same way: a compressed group crosses chunk boundaries;
* the compressed-KV and index-key writes of every device's slots (fp4-valued bf16 ``A`` and
  index-key ``I`` entries, and int32 destinations), all-gathered.

Once per step the hidden states come back: only the kept tokens' rows under compact YOCO
truncation (an exact all-reduce of ``T'`` rows of ``C x D``; ``T'`` is about 140 per prompt), so
this model leaves them out; without truncation it is an all-gather of ``T`` rows.

Against that, the device no longer computes ``(P-1)/P`` of the step's per-token work: the
attention over ``W + index_topk`` keys per query and the indexer's scores, which grow with the
position (``p / r`` compressed keys per query; the mirror layout makes that causal part equal
per device). Times use nominal H200 rates (NVLink 450 GB/s per direction, 989 dense bf16
TFLOP/s): the ratio says whether the exchange can hide behind the saved work, not what a run
measures.

    python scripts/cp_comm_model.py [--out benchmarks/results/cp_comm_model.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

LINK_BPS = 450e9      # H200 NVLink, one direction
FLOPS = 989e12        # H200 dense bf16


def layer_cost(cfg, layer: int, T: int, P: int) -> dict:
    A, H, D = cfg.head_dim, cfg.num_attention_heads, cfg.hidden_size
    r = cfg.compress_ratios[layer]
    f = (P - 1) / P
    moved = f * T * A * 2                                   # window KV
    source = layer in cfg.kv_source_layer_ids
    if source and r > 1:
        moved += f * T * 2 * A * 4                          # compressor kv + score (fp32)
    if source and r:
        moved += f * T * (A * 2 + 4)                        # compressed-KV writes + destinations
        if layer in cfg.index_source_layer_ids:
            moved += f * T * (cfg.index_head_dim * 2 + 4)   # index-key writes + destinations
    # per-token work a device no longer does: attention over window + selected keys, the indexer
    # over the compressed keys visible at each position (mean position T/2 for a chunk from 0)
    keys = cfg.sliding_window + (cfg.index_topk if r else 0)
    attn = 4 * H * A * keys
    index = 2 * cfg.index_n_heads * cfg.index_head_dim * (T / 2) / r if layer in cfg.index_source_layer_ids else 0.0
    dense = 2 * (D * cfg.q_lora_rank + cfg.q_lora_rank * H * A + D * A + H * A * cfg.o_lora_rank
                 + cfg.o_groups * cfg.o_lora_rank * D)
    saved = f * T * (attn + index + dense)
    return dict(bytes=moved, saved_flops=saved)


def main(argv=None) -> int:
    from deepinfer_jax.config import preset

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON path (default: print only)")
    args = ap.parse_args(argv)
    cfg = preset("v41-flash")
    rows = []
    print(f"{'tokens/rank':>11} {'cp':>3} {'MB in/dev/step':>15} {'link ms':>8} {'saved ms':>9} {'ratio':>6}")
    for T in (8192, 32768):
        for P in (2, 4, 8):
            costs = [layer_cost(cfg, l, T, P) for l in range(cfg.yoco_start_layer)]
            b = sum(c["bytes"] for c in costs)
            s = sum(c["saved_flops"] for c in costs)
            link, saved = b / LINK_BPS * 1e3, s / FLOPS * 1e3
            rows.append(dict(tokens_per_rank=T, cp=P, bytes_in_per_device=b, link_ms=link,
                             saved_compute_ms=saved, link_over_saved=link / saved))
            print(f"{T:>11} {P:>3} {b / 1e6:>15.1f} {link:>8.2f} {saved:>9.2f} {link / saved:>6.3f}")
    print("(layers before YOCO truncation's decoder layers, which run whole on every cp device)")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(dict(model="v41-flash", link_Bps=LINK_BPS, flops=FLOPS, rows=rows), fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
