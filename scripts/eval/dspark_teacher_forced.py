#!/usr/bin/env python3
"""Teacher-forced DSpark acceptance of a model's stages on given sequences, by anchor range: the
training metric (``greedy_match`` per draft position, ``tau_prob``), measured outside training.

    python scripts/eval/dspark_teacher_forced.py --model DIR --sequences regen.npy --seq-len 1024 \\
        [--rows 8] [--ranges 257:300 300:384 600:1000] [--heldout heldout.npy --heldout-new 160] \\
        [--out FILE.json]

``--sequences``: a stack of sequences (``scripts/train/regenerate_data.py``'s ``regen.npy``;
``--rows`` evenly spaced ones are used). ``--heldout``: also continue ``--rows`` held-out
prompts (windows of ``--prompt-len`` at seed 0, as ``dspark_acceptance.py --heldout`` cuts them)
greedily with the model and measure the same figures on those continuations. The two side by side
tell memorised training sequences (high on the first, low on the second) from a train-vs-serve
mismatch (the real loop far below the second).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(HERE, "..", "train"))
sys.path.insert(0, HERE)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--sequences", default=None)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--anchors", type=int, default=16, help="anchors per row and range")
    ap.add_argument("--ranges", nargs="+", default=["257:300", "300:384", "600:1000"])
    ap.add_argument("--heldout", default=None)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--heldout-new", type=int, default=160)
    ap.add_argument("--work", default=None, help="where an fp8 model's bf16 copy goes (default: a temporary directory)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    ranges = []
    for r in a.ranges:
        lo, _, hi = r.partition(":")
        try:
            ranges.append((int(lo), int(hi)))
        except ValueError:
            raise SystemExit(f"--ranges: {r!r} is not LO:HI") from None

    from dspark_acceptance import heldout_prompts
    from train_dspark import engram_ids_fn, load_backbone

    from deepinfer_jax.models.weights import load_model
    from deepinfer_jax.runner.engram_hash import EngramHasher
    from deepinfer_jax.runner.regenerate import continue_prompts
    from deepinfer_jax.training.dspark_step import DSparkTrainer
    from deepinfer_jax.training.optimizer import OptimConfig

    sets = {}
    if a.sequences:
        seqs = np.load(a.sequences).reshape(-1, a.seq_len)
        sets["sequences"] = seqs[np.linspace(0, len(seqs) - 1, a.rows).astype(int)].astype(np.int32)
    if a.heldout:
        target = load_model(a.model, progress=False)
        tok = os.path.join(a.model, "tokenizer.json")
        hasher = EngramHasher.from_model_config(target.cfg, tok) if target.cfg.engram_enabled else None
        prompts = np.asarray(heldout_prompts(a.heldout, a.rows, a.prompt_len, 0), np.int32)
        banned = [target.cfg.pad_token_id, target.cfg.dspark_noise_token_id]
        sets["heldout_greedy"] = continue_prompts(target, prompts, a.heldout_new, batch_size=a.rows, hasher=hasher,
                                                  banned_ids=banned, prefill_rows=a.rows)
    if not sets:
        raise SystemExit("nothing to measure: give --sequences and/or --heldout")
    model, _, _ = load_backbone(a.model, a.work or tempfile.mkdtemp(prefix="dspark_teacher_forced_"))
    trainer = DSparkTrainer(model, OptimConfig(), a.anchors)
    master = trainer.init_state().master
    ids_fn = engram_ids_fn(model.cfg, a.model)
    results = []
    for name, data in sets.items():
        eids = ids_fn(data) if ids_fn else None
        for lo, hi in ranges:
            hi = min(hi, data.shape[1] - 1)
            if lo >= hi:
                continue
            anc = np.random.default_rng(0).integers(lo, hi, size=(len(data), a.anchors)).astype(np.int32)
            m = trainer.evaluate(master, data, eids, anc)
            row = {"set": name, "anchors": [lo, hi], "greedy_match": [round(x, 4) for x in m["greedy_match"]],
                   "tau_prob": round(m["tau_prob"], 4),
                   "distinct_token_share": float(np.mean([len(np.unique(r[lo:hi])) / (hi - lo) for r in data]))}
            results.append(row)
            print(f"{name:15s} anchors {lo:>4}-{hi:<4} greedy match {row['greedy_match']}  tau_prob {row['tau_prob']:.3f}",
                  flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"model": a.model, "sequences": a.sequences, "heldout": a.heldout, "rows": a.rows,
                       "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
