#!/usr/bin/env python3
"""Do repeated tails teach the DSpark stages to copy loops? A CPU-sized run of the shipped stages.

The shipped model's stages (its fp8 checkpoint dequantized exactly to bf16) train on this
package's own sources (never in the model's training data; the first 80 % of its tokens), with a
fraction ``--frac`` of the windows ending in a repeated period (``training/repeat_tail.py``). Before
and after, the teacher-forced greedy match with the target's argmax by block position on
held-out windows (the last 20 %) twice: as they are, and with every window's tail repeated
(periods 2-24, anchors in the last 36 positions, where the loop has shown itself). The GPU run
of the same recipe is ``gpu_pipeline.sh stages`` with ``REPEAT_FRAC``. Prints a table, writes JSON.

    python scripts/train/repeat_tail_probe.py [--steps 900] [--frac 0.5] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="v41-small-code")
    ap.add_argument("--steps", type=int, default=900)
    ap.add_argument("--frac", type=float, default=0.5)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--anchors", type=int, default=32)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.steps < 1 or args.seq_len < 128:
        raise SystemExit(f"--steps={args.steps} must be >= 1 and --seq-len={args.seq_len} >= 128")

    import jax
    import numpy as np
    from tqdm.auto import tqdm

    from train import engram_ids_fn            # scripts/train/train.py
    from train_dspark import load_backbone     # scripts/train/train_dspark.py

    from deepinfer_jax.models.registry import resolve_model
    from deepinfer_jax.tokenizer.loader import load_tokenizer
    from deepinfer_jax.training.data import TokenBatches
    from deepinfer_jax.training.dspark_step import DSparkTrainer
    from deepinfer_jax.training.optimizer import OptimConfig
    from deepinfer_jax.training.repeat_tail import RepeatTail

    d = resolve_model(args.model, progress=False)
    model, _, _ = load_backbone(d, tempfile.mkdtemp(prefix="repeat_tail_probe_"))   # an fp8 one as its exact bf16 copy
    cfg = model.cfg
    tok = load_tokenizer(d, bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id)
    eng = engram_ids_fn(cfg, d) or (lambda T: None)
    root = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "deepinfer_jax"))
    ids: list[int] = []
    for f in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        with open(f, encoding="utf-8") as fh:
            ids += tok.encode(fh.read())
    ids_N = np.asarray(ids, np.int32)
    cut = int(len(ids_N) * 0.8)
    L = args.seq_len

    src = TokenBatches(ids_N[:cut], args.batch, L, seed=0)
    batches = RepeatTail(src, args.frac, seed=0) if args.frac else src
    oc = OptimConfig(lr=args.lr, warmup_steps=min(10, args.steps), total_steps=args.steps)
    tr = DSparkTrainer(model, oc, num_anchors=args.anchors)
    st = tr.init_state()
    held = TokenBatches(ids_N[cut:], 8, L, seed=9)(0)
    looped = RepeatTail(lambda i: held, 1.0, seed=9, min_period=2, max_period=24)(0)
    late = np.tile(np.arange(L - 38, L - 2, 2, dtype=np.int32)[None], (8, 1))   # loops visible by then

    def evaluate(master) -> dict:
        return {"held_out": [round(float(x), 4) for x in tr.evaluate(master, held, eng(held), seed=1)["greedy_match"]],
                "held_out_looped": [round(float(x), 4) for x in
                                    tr.evaluate(master, looped, eng(looped), anchors_BA=late)["greedy_match"]]}

    before = evaluate(st.master)
    t0 = time.time()
    for k in tqdm(range(args.steps), desc="stages", unit="step"):
        T = batches(k)
        st, m = tr.step(st, T, eng(T))
    wall = time.time() - t0
    after = evaluate(st.master)
    blk = cfg.dspark_block_size
    print(f"{args.steps} steps x {args.batch * args.anchors} blocks, frac {args.frac}, {wall:.0f} s")
    print(f"{'draft == target argmax':28} " + " ".join(f"pos {i + 1:>2}" for i in range(blk)))
    for when, ev in (("before", before), ("after", after)):
        for k, v in ev.items():
            print(f"{when + ' ' + k:28} " + " ".join(f"{x:6.3f}" for x in v))
    path = args.out or os.path.join("benchmarks", "results", f"repeat_tail_probe_{jax.default_backend()}.json")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as fh:
        json.dump({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "platform": jax.default_backend(), "jax": jax.__version__, "args": vars(args),
                   "train_tokens": cut, "blocks": args.steps * args.batch * args.anchors, "wall_s": round(wall, 1),
                   "before": before, "after": after}, fh, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
