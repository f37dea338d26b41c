#!/usr/bin/env python
"""Training curves of a run as a PNG (needs matplotlib: ``pip install matplotlib``):

    python scripts/train/plot_training.py --run DIR [--heldout heldout_bpb.json] --out curves.png

``--run``: a ``train.py`` / ``train_dspark.py`` output directory (``metrics.jsonl``, ``meta.json``;
``dspark_metrics.jsonl`` when the DSpark stages were trained there; either log may be gzipped, ``.gz``). Panels: the backbone's
next-token loss (nats per token) against tokens seen, with the held-out figure and the
compressors' bits per byte converted to nats per token when ``--heldout`` is given
(``scripts/train/evaluate_model.py``'s JSON); the indexers' KL and the experts' load imbalance;
the DSpark loss and its probabilistic tau. A step logged twice (a call that resumed from an
earlier save) is drawn once, its last record.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import sys


def run_file(run: str, name: str) -> str:
    """``run/name``, or ``run/name.gz`` where only the compressed copy exists (committed results
    keep their large logs gzipped)."""
    path = os.path.join(run, name)
    return path + ".gz" if not os.path.exists(path) and os.path.exists(path + ".gz") else path


def read_jsonl(path: str) -> list[dict]:
    by_step: dict[int, dict] = {}
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                by_step[int(rec["step"])] = rec
    return [by_step[k] for k in sorted(by_step)]


def smooth(y: list[float], k: int = 25) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(y):
        acc += v
        if i >= k:
            acc -= y[i - k]
        out.append(acc / min(i + 1, k))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True)
    ap.add_argument("--heldout", default=None)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("plot_training.py needs matplotlib: pip install matplotlib") from None
    meta = json.load(open(os.path.join(a.run, "meta.json")))
    m = read_jsonl(run_file(a.run, "metrics.jsonl"))
    tok_per_step = meta["batch"] * meta["seq_len"]
    x = [r["step"] * tok_per_step / 1e6 for r in m]
    ds_path = run_file(a.run, "dspark_metrics.jsonl")
    d = read_jsonl(ds_path) if os.path.exists(ds_path) else []
    fig, axes = plt.subplots(1, 3 if d else 2, figsize=(16 if d else 11, 4.2))
    ax = axes[0]
    ax.plot(x, [r["loss"] for r in m], lw=0.5, alpha=0.35, color="C0")
    ax.plot(x, smooth([r["loss"] for r in m]), lw=1.5, color="C0", label="train loss (25-step mean)")
    if a.heldout:
        h = json.load(open(a.heldout))
        bpt = h["heldout_bytes"] / max(h["heldout_tokens"], 1)  # bytes per token of the held-out text
        for r in h["models"]:
            if "random" in r["model"]:
                continue
            ax.axhline(r["bits_per_token"] * math.log(2), color="C3", ls="--", lw=1,
                       label=f"held-out, {r['weight_dtype']}/{r['expert_dtype']} export: {r['bits_per_byte']:.3f} bits/byte")
        base = h.get("baselines_bits_per_byte", {})
        for key, col in (("xz_bpb", "C2"), ("gzip_bpb", "C7"), ("target_bpb", "k")):
            if isinstance(base.get(key), (int, float)):
                ax.axhline(base[key] * bpt * math.log(2), color=col, ls=":", lw=1,
                           label=f"{key.replace('_bpb', '')}: {base[key]:.3f} bits/byte")
    ax.set_xlabel("tokens seen (M)")
    ax.set_ylabel("nats / token")
    ax.set_ylim(bottom=0)
    ax.set_title("backbone next-token loss")
    ax.legend(fontsize=7)
    ax = axes[1]
    ax.plot(x, smooth([r.get("indexer_kl", float("nan")) for r in m]), color="C1", label="indexer KL (nats)")
    ax.set_xlabel("tokens seen (M)")
    ax.set_ylabel("KL")
    ax2 = ax.twinx()
    ax2.plot(x, smooth([r.get("expert_imbalance", float("nan")) for r in m]), color="C4",
             label="expert load: max / mean")
    ax2.set_ylabel("max / mean load")
    ax.set_title("indexer objective and expert balance")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=7)
    if d:
        ax = axes[2]
        s = [r["step"] for r in d]
        ax.plot(s, smooth([r["loss"] for r in d]), color="C0", label="DSpark loss")
        ax.set_xlabel("DSpark step")
        ax.set_ylabel("loss")
        ax2 = ax.twinx()
        ax2.plot(s, smooth([r["tau_prob"] for r in d]), color="C5", label="tau (probabilistic, train)")
        ax2.set_ylabel("tau")
        ax.set_title("DSpark stages (frozen backbone)")
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, fontsize=7)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
