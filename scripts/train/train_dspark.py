#!/usr/bin/env python
"""Train the DSpark draft stages (``mtp.K.*``) of a trained backbone, frozen, with the DSpark
objective (``training/dspark_loss.py``).

    python scripts/train/train_dspark.py --model-run runs/tiny --data tokens.npy --steps 200 \\
        --batch 8 --seq-len 32 --anchors 8 --lr 6e-4 --out runs/tiny [--resume] \\
        [--time-budget 540] [--export runs/tiny/export-dspark --export-dtype bf16]

``--model-run``: a backbone run of ``scripts/train/train.py`` (its ``--out``: ``state.npz`` +
``meta.json``; the config must have DSpark stages, e.g. ``v41-train-tiny-dspark``; the stages start
from that run's init values, which its training froze) or an exported bf16 checkpoint directory
(``config.json`` + safetensors; an fp8 / fp4 one is first dequantized, exactly, to
``<out>/backbone_bf16``, so the shipped model trains as it is). Writes ``<out>/dspark_state.npz``, ``dspark_meta.json``,
``dspark_metrics.jsonl`` (so ``--out`` may be the backbone run's directory). ``--export`` writes
the whole model with the trained stages (and, from a run, the backbone's fp32 masters for an fp8
export to quantize from). Configs with Engram layers: ``--tokenizer`` as in ``train.py``.
``--repeat-frac F``: a fraction F of the windows end in a repeated period, as the target's greedy
loops do (``training/repeat_tail.py``), so the stages learn to copy them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from train import add_run_args, engram_ids_fn, load_data, schedule_from_args  # noqa: E402  (scripts/train/train.py)

from deepinfer_jax.config import ModelConfig  # noqa: E402
from deepinfer_jax.training import data as D  # noqa: E402
from deepinfer_jax.training import state_io  # noqa: E402
from deepinfer_jax.training.dspark_loss import DSparkLossConfig  # noqa: E402
from deepinfer_jax.training.dspark_step import DSparkTrainer  # noqa: E402
from deepinfer_jax.training.export import export_checkpoint  # noqa: E402
from deepinfer_jax.training.init import init_model  # noqa: E402
from deepinfer_jax.training.loop import run  # noqa: E402
from deepinfer_jax.training.optimizer import OptimConfig  # noqa: E402
from deepinfer_jax.training.repeat_tail import RepeatTail  # noqa: E402
from deepinfer_jax.training.step import Trainer  # noqa: E402


def load_backbone(path: str, out_dir: str):
    """``(model, backbone fp32 masters or None, description)`` of a backbone run or an export."""
    if state_io.has_state(path):
        meta = state_io.load_meta(path)
        cfg = ModelConfig.from_hf_dict(meta["config"])
        bt = Trainer(init_model(cfg, meta.get("data_seed", 0)), OptimConfig(**meta["optim"]))
        st = state_io.load_state(path, bt.init_state())
        return bt.model(st.master), st.master, f"run {path} step {st.step}"
    if os.path.isfile(os.path.join(path, "config.json")):
        from deepinfer_jax.models.weights import load_model

        cfg = ModelConfig.from_json(path)
        src = f"export {path}"
        if cfg.weight_dtype != "bf16" or cfg.expert_dtype != "bf16":  # the stages train on bf16 storage
            from deepinfer_jax.checkpoint.dequantize import dequantize_checkpoint

            bf16_dir = os.path.join(out_dir, "backbone_bf16")
            dequantize_checkpoint(path, bf16_dir)
            print(f"{cfg.weight_dtype}/{cfg.expert_dtype} checkpoint {path}: training on its exact bf16 copy {bf16_dir}")
            path, src = bf16_dir, f"export {path} (dequantized to bf16, values exact)"
        return load_model(path), None, src
    raise SystemExit(f"--model-run={path!r}: neither a training run (state.npz) nor a checkpoint (config.json)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-run", required=True)
    add_run_args(ap, lr=6e-4)
    ap.add_argument("--anchors", type=int, default=8, help="draft blocks per sequence per step")
    ap.add_argument("--gamma", type=float, default=4.0)
    ap.add_argument("--ce-alpha", type=float, default=0.1)
    ap.add_argument("--l1-alpha", type=float, default=0.9)
    ap.add_argument("--conf-alpha", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0, help="data order and anchors")
    ap.add_argument("--sequences", action="store_true",
                    help="--data is a stack of sequences of --seq-len tokens (scripts/train/regenerate_data.py): "
                         "windows are whole sequences")
    ap.add_argument("--anchor-low", type=int, default=1,
                    help="first anchor position (the prompt length of regenerated sequences: blocks "
                         "only in the model's own continuations)")
    ap.add_argument("--repeat-frac", type=float, default=0.0,
                    help="fraction of the windows whose tail repeats the period just before it, as the target's "
                         "greedy loops do (training/repeat_tail.py); 0: the data as it is")
    ap.add_argument("--repeat-period", type=int, nargs=2, default=(2, 64), metavar=("MIN", "MAX"),
                    help="the repeated period's length range, in tokens")
    a = ap.parse_args(argv)

    model, backbone_master, src = load_backbone(a.model_run, a.out)
    cfg = model.cfg
    steps, oc = schedule_from_args(a, auto_warmup=50)
    lc = DSparkLossConfig(a.gamma, a.ce_alpha, a.l1_alpha, a.conf_alpha)
    tokens = load_data(a, cfg.vocab_size)
    batches = D.TokenBatches(tokens, a.batch, a.seq_len, a.seed, cfg.vocab_size, aligned=a.sequences)
    if a.repeat_frac:
        batches = RepeatTail(batches, a.repeat_frac, a.seed, *a.repeat_period)
    trainer = DSparkTrainer(model, oc, a.anchors, lc, anchor_seed=a.seed, anchor_low=a.anchor_low)
    meta = {"config": json.loads(json.dumps(cfg.to_hf_dict())), "optim": dataclasses.asdict(oc),
            "batch": a.batch, "seq_len": a.seq_len, "data_seed": a.seed, "data": a.data,
            "data_sequences": a.sequences, "anchors": a.anchors, "anchor_seed": a.seed, "anchor_low": a.anchor_low,
            "dspark_loss": dataclasses.asdict(lc), "model_run": src}
    if a.repeat_frac:
        meta["repeat_tail"] = {"frac": a.repeat_frac, "periods": list(a.repeat_period)}
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
