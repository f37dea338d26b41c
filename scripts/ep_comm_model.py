#!/usr/bin/env python3
"""Modelled bytes one device moves per MoE layer and step, for each expert-parallel scheme of
``kernels_pallas/moe_ep.py``, at DeepInfer's V4.1-Flash deployments (a model, not a measurement:
the choice of scheme is argued with these numbers until a multi-GPU run measures them).

Per device: ``t`` tokens of its own (attention data parallel), ``X`` routed slots per token,
hidden ``D``, an EP group of ``n`` devices. Activations cross as bf16 (2 bytes; an fp8 dispatch
would halve the dispatch column). Ring collectives: an all-reduce of ``B`` bytes moves
``2 B (n-1)/n`` per device, an all-gather of a ``B``-byte result ``B (n-1)/n``.

* ``psum``: every device needs every token (all-gather ``n t D``), computes its experts' rows of
  all ``n t X`` entries and all-reduces the ``[n t, X, D]`` result.
* ``a2a`` (tokens split over dp, the target): each entry goes to its expert's device and back;
  ``(n-1)/n`` of the ``t X`` entries leave the device (uniform routing), twice.
* ``a2a_replicated`` (what runs while the batch is not split over dp): the ``a2a`` rows for a
  ``t``-token slice plus the all-gather that rebuilds the replicated ``[n t, X, D]`` output.
* ``capacity``: a dense all-to-all of ``[n, C, D]`` blocks, ``C = cf * t X / n`` rows per
  destination (``cf`` = capacity factor; entries beyond ``C`` would be dropped, which this
  engine never does, so ``cf`` must cover the busiest expert: with EPLB's balance ~1.3).

    python scripts/ep_comm_model.py [--out benchmarks/results/ep_comm_model.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# (name, EP group n, tokens per device t): DeepInfer's decode (EP64, 256 requests x 4 tokens of
# a verification step) and prefill (EP4, 8k and 32k tokens per device)
CASES = (("decode EP64, 256 req x 4 tok", 64, 1024), ("decode EP64, 256 req x 1 tok", 64, 256),
         ("prefill EP4, 8k tok", 4, 8192), ("prefill EP4, 32k tok", 4, 32768))


def bytes_per_layer(n: int, t: int, X: int, D: int, cf: float = 1.3, elt: int = 2) -> dict[str, float]:
    f = (n - 1) / n
    row = D * elt
    return {
        "psum": n * t * row * f + 2 * n * t * X * row * f,
        "a2a": 2 * t * X * row * f,
        "a2a_replicated": 2 * t * X * row * f + n * t * X * row * f,
        "capacity": 2 * n * (cf * t * X / n) * row * f,
    }


def main(argv=None) -> int:
    from deepinfer_jax.config import preset

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--capacity-factor", type=float, default=1.3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cfg = preset("v41-flash")
    X, D, L = cfg.num_experts_per_tok, cfg.hidden_size, cfg.num_hidden_layers
    rows = []
    print(f"V4.1-Flash: D={D}, X={X} routed slots, {L} MoE layers; MB per device per layer (bf16 rows)")
    print(f"{'case':32} {'psum':>9} {'a2a':>9} {'a2a_repl':>9} {'capacity':>9} {'psum/a2a':>9}")
    for name, n, t in CASES:
        b = bytes_per_layer(n, t, X, D, args.capacity_factor)
        rows.append(dict(case=name, ep=n, tokens_per_device=t, **{k: v for k, v in b.items()}))
        print(f"{name:32} {b['psum'] / 1e6:9.1f} {b['a2a'] / 1e6:9.1f} {b['a2a_replicated'] / 1e6:9.1f} "
              f"{b['capacity'] / 1e6:9.1f} {b['psum'] / b['a2a']:9.1f}")
    out = args.out or os.path.join("benchmarks", "results", "ep_comm_model.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as fh:
        json.dump({"model": "v41-flash", "hidden": D, "routed_slots": X, "moe_layers": L,
                   "capacity_factor": args.capacity_factor, "bytes_per_device_per_layer": rows,
                   "note": "modelled (uniform routing, ring collectives), not measured"}, fh, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
