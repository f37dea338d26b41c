#!/usr/bin/env python
"""Train a V4.1-architecture model (bf16 storage, fp32 master weights) on a file of token ids.

    python scripts/train/train.py --config v41-train-tiny --data tokens.npy --steps 200 \
        --batch 8 --seq-len 32 --lr 3e-3 --out runs/tiny [--resume] [--time-budget 540] \
        [--export runs/tiny/export --export-dtype fp8]

``--config``: a preset (``v41-train-tiny``, ``v41-tiny``, ...) or a config.json. ``--data``: .npy
(1-D) or a raw .bin of ``--data-dtype``; ``--data synthetic:PERIOD`` uses a repeating phrase.
``--steps`` is the run's total (``--steps auto --train-seconds S``: sized after a few timed steps so
that stepping takes about S seconds over all calls; the choice is kept in meta.json): with ``--resume`` a later call continues from ``<out>/state.npz``
(a run can span several calls of limited time, see ``--time-budget``). Writes
``<out>/metrics.jsonl``, ``state.npz``, ``meta.json``; ``--export`` writes an official-format
checkpoint of the trained weights (``--export-dtype bf16`` or ``fp8``: fp8 dense, fp4 experts).
Configs with Engram layers: the hash ids of each batch come from the runner's host hasher, built
from ``--tokenizer`` (a ``tokenizer.json`` or the model directory holding it) or, without it, the
identity token map (token id = compressed id).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import numpy as np

from deepinfer_jax.training import data as D
from deepinfer_jax.training import state_io
from deepinfer_jax.training.export import export_checkpoint
from deepinfer_jax.training.init import init_model
from deepinfer_jax.training.loop import run
from deepinfer_jax.training.optimizer import OptimConfig
from deepinfer_jax.training.presets import train_config
from deepinfer_jax.training.step import Trainer


def engram_ids_fn(cfg, tokenizer: str | None):
    """None without Engram layers; else tokens ``[B, L]`` -> the host hasher's ids ``[B, L,
    n_engram_layers, n_hash_cols]`` of positions ``0..L-1`` of each row (what the driver computes)."""
    if not cfg.engram_enabled:
        return None
    from deepinfer_jax.runner.engram_hash import EngramHasher

    path = tokenizer
    if path is not None and os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if path is not None and not os.path.isfile(path):
        raise SystemExit(f"--tokenizer={tokenizer!r}: no tokenizer.json there")
    hasher = EngramHasher.from_model_config(cfg, path)
    return lambda toks: np.stack([hasher.hash_positions(t, np.arange(len(t))) for t in np.asarray(toks)])


def add_run_args(ap, lr: float) -> None:
    """The data, schedule and run options both training scripts take."""
    ap.add_argument("--data", required=True)
    ap.add_argument("--data-dtype", default="uint16")
    ap.add_argument("--steps", required=True, help="total optimizer steps, or 'auto' (with --train-seconds)")
    ap.add_argument("--train-seconds", type=float, default=None,
                    help="with --steps auto: the stepping time of the whole run (all calls)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--lr", type=float, default=lr)
    ap.add_argument("--warmup", type=int, default=None,
                    help="warmup steps (default: 5%% of --steps; with auto a fixed count)")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--save-every", type=int, default=50)
    ap.add_argument("--time-budget", type=float, default=None, help="seconds; save and stop after")
    ap.add_argument("--export", default=None)
    ap.add_argument("--export-dtype", choices=("bf16", "fp8"), default="bf16")
    ap.add_argument("--export-shard-mb", type=float, default=1024.0, help="largest safetensors file of the export")
    ap.add_argument("--tokenizer", default=None,
                    help="tokenizer.json (or its model directory) for the Engram hasher's token map")


def schedule_from_args(a, auto_warmup: int) -> tuple[int | None, OptimConfig]:
    """``(steps or None for auto, OptimConfig)`` from the parsed options."""
    if a.steps == "auto":
        if not a.train_seconds or a.train_seconds <= 0:
            raise SystemExit("--steps auto: needs --train-seconds > 0")
        warmup = a.warmup if a.warmup is not None else auto_warmup
        return None, OptimConfig(lr=a.lr, warmup_steps=warmup, total_steps=max(warmup, 1),
                                 weight_decay=a.weight_decay, clip_norm=a.clip)
    try:
        steps = int(a.steps)
    except ValueError:
        raise SystemExit(f"--steps={a.steps!r}: an integer or 'auto'") from None
    warmup = a.warmup if a.warmup is not None else max(1, steps // 20)
    return steps, OptimConfig(lr=a.lr, warmup_steps=min(warmup, steps), total_steps=steps,
                              weight_decay=a.weight_decay, clip_norm=a.clip)


def load_data(a, vocab_size: int):
    if a.data.startswith("synthetic:"):
        return D.repeating_pattern(max(4096, 4 * a.seq_len), int(a.data.split(":", 1)[1]), vocab_size, a.seed)
    return D.load_tokens(a.data, a.data_dtype)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="v41-train-tiny")
    add_run_args(ap, lr=3e-3)
    ap.add_argument("--seed", type=int, default=0, help="init weights and data order")
    a = ap.parse_args(argv)

    cfg = train_config(a.config, a.tokenizer)
    steps, oc = schedule_from_args(a, auto_warmup=200)
    tokens = load_data(a, cfg.vocab_size)
    batches = D.TokenBatches(tokens, a.batch, a.seq_len, a.seed, cfg.vocab_size)
    trainer = Trainer(init_model(cfg, a.seed), oc)
    meta = {"config": json.loads(json.dumps(cfg.to_hf_dict())), "optim": dataclasses.asdict(oc),
            "batch": a.batch, "seq_len": a.seq_len, "data_seed": a.seed, "data": a.data}
    state = run(trainer, batches, steps, a.out, meta, resume=a.resume, save_every=a.save_every,
                time_budget_s=a.time_budget, engram_ids_fn=engram_ids_fn(cfg, a.tokenizer),
                train_seconds=a.train_seconds)
    total = state_io.load_meta(a.out).get("total_steps", steps)
    print(f"step {state.step}/{total}; state in {a.out}")
    if a.export and total is not None and state.step >= total:
        export_checkpoint(trainer, state.master, a.export, a.export_dtype,
                          max_shard_bytes=int(a.export_shard_mb * 2**20))
        print(f"exported ({a.export_dtype}) to {a.export}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
