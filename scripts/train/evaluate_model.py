#!/usr/bin/env python
"""Held-out bits per byte of model checkpoints, next to gzip / xz on the same bytes:

    python scripts/train/evaluate_model.py --corpus DIR --model EXPORT_DIR [--model ...] \
        [--random-init] [--seq-len 1024] [--batch 16] [--max-windows N] --out figures.json

``--corpus``: ``prepare_corpus.py``'s directory (heldout.npy, corpus_stats.json with the held-out
bytes and the compressors' figures, tokenizer.json for the Engram hasher). ``--model``: model
directories (``load_model``: a bf16 and an fp8 export, say). ``--random-init``: also the
untrained model (``training/init.py``, seed 0) of the first model's config. Prints a table and
writes JSON. ``--max-windows`` evaluates a prefix of the held-out windows (the bytes counted
scale with the tokens kept; for smoke runs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from deepinfer_jax.config import ModelConfig  # noqa: E402
from deepinfer_jax.models.weights import load_model  # noqa: E402
from deepinfer_jax.runner.engram_hash import EngramHasher  # noqa: E402
from deepinfer_jax.training.evaluate import bits_per_byte  # noqa: E402
from deepinfer_jax.training.forward import train_logits  # noqa: E402
from deepinfer_jax.training.init import init_model  # noqa: E402
from deepinfer_jax.training.loss import next_token_loss  # noqa: E402


def loss_fn_of(model, tokenizer_json: str | None):
    """tokens [B, L] -> (mean nll, count) of ``model`` (jitted, one compile per shape)."""
    cfg = model.cfg
    graphdef, state = nnx.split(model)
    hasher = EngramHasher.from_model_config(cfg, tokenizer_json) if cfg.engram_enabled else None

    @jax.jit
    def f(state, toks, eids):
        m = nnx.merge(graphdef, state)
        return next_token_loss(train_logits(m, toks, eids), toks, cfg.pad_token_id)

    def loss(toks):
        eids = None
        if hasher is not None:
            eids = np.stack([hasher.hash_positions(t, np.arange(len(t))) for t in toks]).astype(np.int32)
        mean, n = f(state, toks, eids)
        return float(mean), float(n)

    return loss


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--model", action="append", default=[])
    ap.add_argument("--random-init", action="store_true")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-windows", type=int, default=None)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if not a.model:
        ap.error("--model: at least one model directory")
    stats = json.load(open(os.path.join(a.corpus, "corpus_stats.json")))
    tokens = np.load(os.path.join(a.corpus, "heldout.npy"))
    n_bytes = int(stats["splits"]["heldout"]["bytes"])
    if a.max_windows:
        keep = min(len(tokens), a.max_windows * (a.seq_len - 1) + 1)
        n_bytes = int(round(n_bytes * keep / len(tokens)))
        tokens = tokens[:keep]
    tok_json = os.path.join(a.corpus, "tokenizer.json")
    rows = []
    models = [(d, lambda d=d: load_model(d)) for d in a.model]
    if a.random_init:
        cfg0 = ModelConfig.from_json(a.model[0]).replace(weight_dtype="bf16", expert_dtype="bf16")
        models.append(("random-init (seed 0)", lambda: init_model(cfg0, 0)))
    for name, make in models:
        t = time.time()
        model = make()
        r = bits_per_byte(loss_fn_of(model, tok_json), tokens, n_bytes, a.seq_len, a.batch, model.cfg.pad_token_id)
        r |= {"model": name, "weight_dtype": model.cfg.weight_dtype, "expert_dtype": model.cfg.expert_dtype,
              "seconds": round(time.time() - t, 1)}
        rows.append(r)
    base = stats.get("heldout_baselines", {})
    out = {"corpus": os.path.abspath(a.corpus), "heldout_bytes": n_bytes, "heldout_tokens": int(len(tokens)),
           "baselines_bits_per_byte": base, "models": rows, "jax": jax.__version__,
           "device": jax.devices()[0].device_kind}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=2)
    print(f"{'model':<40} {'dtype':<10} {'bits/byte':>10} {'bits/token':>11}")
    for r in rows:
        print(f"{os.path.basename(r['model'].rstrip('/')):<40} {r['weight_dtype'] + '/' + r['expert_dtype']:<10} "
              f"{r['bits_per_byte']:>10.4f} {r['bits_per_token']:>11.4f}")
    for k, v in base.items():
        print(f"{k:<40} {'':<10} {v if not isinstance(v, dict) else v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
