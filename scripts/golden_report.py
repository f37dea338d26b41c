#!/usr/bin/env python3
"""How far our model is from the golden reference tensors, tap by tap (a diagnostic table).

For each golden tiny config it runs the golden call sequence (``tests/golden_run.py``: prefill
with taps, teacher-forced decode steps, DSpark drafts) and prints:

* prefill: per layer, the attention output and block output as (fraction of elements that
  differ, max |diff|), and whether the routed experts agree on every row;
* decode: per step, the logits' mean / max |diff|, the first layer whose expert choice differs
  from the reference (a near-tie flip), and the greedy token check.

Use it to see where a platform's numerics depart (e.g. the GPU vs the CPU), which the golden
tests only answer pass/fail. ``--json FILE`` writes the numbers.

    python scripts/golden_report.py                       # all clean configs, tests/golden (vendored)
    DEEPINFER_KERNELS=ref python scripts/golden_report.py tiny_bf16
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

CLEAN = ("tiny_fp8", "tiny_bf16", "tiny_fp8_long_allsel")


def _diff(ours, ref) -> tuple[float, float]:
    o, r = np.asarray(ours, np.float32).ravel(), np.asarray(ref, np.float32).ravel()
    return float((o != r).mean()), float(np.abs(o - r).max()) if o.size else 0.0


def report(golden_dir: str, name: str) -> dict:
    from golden_run import run_golden

    r = run_golden(golden_dir, name)
    g, cfg, taps = r["golden"], r["cfg"], r["prefill_taps"]
    out: dict = {"config": name, "prefill_layers": [], "decode_steps": []}
    print(f"== {name}")
    print(f"{'layer':>5} {'attn frac':>9} {'attn max':>9} {'block frac':>10} {'block max':>9} gate")
    for i in range(cfg.num_hidden_layers):
        row = {"layer": i}
        for tap, key in (("attn", f"attn{i}_out"), ("block", f"block{i}_h")):
            if key in taps and f"prefill_{key}" in g:
                row[tap] = _diff(taps[key], g[f"prefill_{key}"][0])
        gi = f"gate{i}_indices"
        if gi in taps and f"prefill_{gi}" in g:
            row["gate_rows_equal"] = float((np.sort(taps[gi], -1) == np.sort(g[f"prefill_{gi}"], -1)).all(-1).mean())
        out["prefill_layers"].append(row)
        a, b = row.get("attn", (np.nan, np.nan)), row.get("block", (np.nan, np.nan))
        print(f"{i:>5} {a[0]:>9.3%} {a[1]:>9.2e} {b[0]:>10.3%} {b[1]:>9.2e} {row.get('gate_rows_equal', np.nan):.2f}")
    d = np.abs(r["prefill_logits_all"] - g["prefill_logits_all"][0])
    out["prefill_logits"] = {"mean": float(d.mean()), "max": float(d.max())}
    print(f"prefill logits: mean {d.mean():.4f} max {d.max():.4f}")
    print(f"{'step':>4} {'mean':>8} {'max':>8} {'first gate flip':>15} token")
    S = g["decode_logits"].shape[1]
    for s in range(S):
        t = r["decode_taps"][s]
        flip = None
        for i in range(cfg.num_hidden_layers):
            k = f"decode{s}_gate{i}_indices"
            if k in g and f"gate{i}_indices" in t:
                if not (np.sort(np.ravel(t[f"gate{i}_indices"])) == np.sort(np.ravel(g[k]))).all():
                    flip = i
                    break
        d = np.abs(r["decode_logits"][s] - g["decode_logits"][0, s])
        tok = int(r["decode_logits"][s].argmax()) == int(g["generated_ids"][0, s + 1])
        out["decode_steps"].append({"step": s, "mean": float(d.mean()), "max": float(d.max()),
                                    "first_gate_flip": flip, "token_ok": tok})
        print(f"{s:>4} {d.mean():>8.4f} {d.max():>8.4f} {'-' if flip is None else f'layer {flip}':>15} {'ok' if tok else 'DIFFERS'}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("configs", nargs="*", default=list(CLEAN))
    ap.add_argument("--golden", default=os.environ.get("DEEPINFER_GOLDEN",
                                                       os.path.join(ROOT, "tests", "golden", "v41_tiny")))
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    import deepinfer_jax  # noqa: F401  (first: it sets the XLA numerics flags before a backend starts)
    import jax

    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; "
          f"DEEPINFER_KERNELS={os.environ.get('DEEPINFER_KERNELS', '(default)')}")
    rows = [report(a.golden, c) for c in a.configs]
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
