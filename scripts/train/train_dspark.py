#!/usr/bin/env python
"""Train the DSpark draft stages (``mtp.K.*``) of a trained backbone, frozen, with the DSpark
objective (``training/dspark_loss.py``).

    python scripts/train/train_dspark.py --model-run runs/tiny --data tokens.npy --steps 200 \\
        --batch 8 --seq-len 32 --anchors 8 --lr 6e-4 --out runs/tiny [--resume] \\
        [--time-budget 540] [--export runs/tiny/export-dspark --export-dtype bf16]

``--model-run``: a backbone run of ``scripts/train/train.py`` (its ``--out``: ``state.npz`` +
``meta.json``; the config must have DSpark stages, e.g. ``v41-train-tiny-dspark``; the stages start
from that run's init values, which its training froze) or an exported bf16 checkpoint directory
(``config.json`` + safetensors). Writes ``<out>/dspark_state.npz``, ``dspark_meta.json``,
``dspark_metrics.jsonl`` (so ``--out`` may be the backbone run's directory). ``--export`` writes
the whole model with the trained stages (and, from a run, the backbone's fp32 masters for an fp8
export to quantize from). Configs with Engram layers: ``--tokenizer`` as in ``train.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from train import engram_ids_fn  # noqa: E402  (scripts/train/train.py)

from deepinfer_jax.config import ModelConfig  # noqa: E402
from deepinfer_jax.training import data as D  # noqa: E402
from deepinfer_jax.training import state_io  # noqa: E402
from deepinfer_jax.training.dspark_loss import DSparkLossConfig  # noqa: E402
from deepinfer_jax.training.dspark_step import DSparkTrainer  # noqa: E402
from deepinfer_jax.training.export import export_checkpoint  # noqa: E402
from deepinfer_jax.training.init import init_model  # noqa: E402
from deepinfer_jax.training.loop import run  # noqa: E402
from deepinfer_jax.training.optimizer import OptimConfig  # noqa: E402
from deepinfer_jax.training.step import Trainer  # noqa: E402


def load_backbone(path: str):
    """``(model, backbone fp32 masters or None, description)`` of a backbone run or an export."""
    if state_io.has_state(path):
        meta = state_io.load_meta(path)
        cfg = ModelConfig.from_hf_dict(meta["config"])
        bt = Trainer(init_model(cfg, meta.get("data_seed", 0)), OptimConfig(**meta["optim"]))
        st = state_io.load_state(path, bt.init_state())
        return bt.model(st.master), st.master, f"run {path} step {st.step}"
    if os.path.isfile(os.path.join(path, "config.json")):
        from deepinfer_jax.models.weights import load_model

        model = load_model(path)
        if model.cfg.weight_dtype != "bf16" or model.cfg.expert_dtype != "bf16":
            raise SystemExit(f"--model-run={path!r}: a {model.cfg.weight_dtype}/{model.cfg.expert_dtype} "
                             "export; the stages train on bf16 storage (export the backbone with bf16)")
        return model, None, f"export {path}"
    raise SystemExit(f"--model-run={path!r}: neither a training run (state.npz) nor a checkpoint (config.json)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-run", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--data-dtype", default="uint16")
    ap.add_argument("--steps", required=True, help="total optimizer steps, or 'auto' (with --train-seconds)")
    ap.add_argument("--train-seconds", type=float, default=None,
                    help="with --steps auto: the stepping time of the whole run (all calls)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--anchors", type=int, default=8, help="draft blocks per sequence per step")
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--warmup", type=int, default=None, help="warmup steps (default: 5%% of --steps)")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--gamma", type=float, default=4.0)
    ap.add_argument("--ce-alpha", type=float, default=0.1)
    ap.add_argument("--l1-alpha", type=float, default=0.9)
    ap.add_argument("--conf-alpha", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0, help="data order and anchors")
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--save-every", type=int, default=50)
    ap.add_argument("--time-budget", type=float, default=None, help="seconds; save and stop after")
    ap.add_argument("--export", default=None)
    ap.add_argument("--export-dtype", choices=("bf16", "fp8"), default="bf16")
    ap.add_argument("--export-shard-mb", type=float, default=1024.0, help="largest safetensors file of the export")
    ap.add_argument("--tokenizer", default=None,
                    help="tokenizer.json (or its model directory) for the Engram hasher's token map")
    a = ap.parse_args(argv)

    model, backbone_master, src = load_backbone(a.model_run)
    cfg = model.cfg
    if a.steps == "auto":
        if not a.train_seconds or a.train_seconds <= 0:
            raise SystemExit("--steps auto: needs --train-seconds > 0")
        steps, warmup = None, a.warmup if a.warmup is not None else 50
        oc = OptimConfig(lr=a.lr, warmup_steps=warmup, total_steps=max(warmup, 1),
                         weight_decay=a.weight_decay, clip_norm=a.clip)
    else:
        try:
            steps = int(a.steps)
        except ValueError:
            raise SystemExit(f"--steps={a.steps!r}: an integer or 'auto'") from None
        warmup = a.warmup if a.warmup is not None else max(1, steps // 20)
        oc = OptimConfig(lr=a.lr, warmup_steps=min(warmup, steps), total_steps=steps,
                         weight_decay=a.weight_decay, clip_norm=a.clip)
    lc = DSparkLossConfig(a.gamma, a.ce_alpha, a.l1_alpha, a.conf_alpha)
    if a.data.startswith("synthetic:"):
        tokens = D.repeating_pattern(max(4096, 4 * a.seq_len), int(a.data.split(":", 1)[1]), cfg.vocab_size, a.seed)
    else:
        tokens = D.load_tokens(a.data, a.data_dtype)
    batches = D.TokenBatches(tokens, a.batch, a.seq_len, a.seed, cfg.vocab_size)
    trainer = DSparkTrainer(model, oc, a.anchors, lc, anchor_seed=a.seed)
    meta = {"config": json.loads(json.dumps(cfg.to_hf_dict())), "optim": dataclasses.asdict(oc),
            "batch": a.batch, "seq_len": a.seq_len, "data_seed": a.seed, "data": a.data,
            "anchors": a.anchors, "anchor_seed": a.seed, "dspark_loss": dataclasses.asdict(lc), "model_run": src}
    state = run(trainer, batches, steps, a.out, meta, resume=a.resume, save_every=a.save_every,
                time_budget_s=a.time_budget, engram_ids_fn=engram_ids_fn(cfg, a.tokenizer),
                prefix=state_io.DSPARK_PREFIX, train_seconds=a.train_seconds)
    total = state_io.load_meta(a.out, state_io.DSPARK_PREFIX).get("total_steps", steps)
    print(f"step {state.step}/{total}; DSpark state in {a.out}/{state_io.DSPARK_PREFIX}{state_io.STATE_FILE}")
    if a.export and total is not None and state.step >= total:
        export_checkpoint(trainer, state.master, a.export, a.export_dtype, backbone_master=backbone_master,
                          max_shard_bytes=int(a.export_shard_mb * 2**20))
        print(f"exported ({a.export_dtype}, trained stages) to {a.export}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
