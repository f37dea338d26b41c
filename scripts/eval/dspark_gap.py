#!/usr/bin/env python3
"""Where the DSpark stages' teacher-forced acceptance and the real loop's part ways.

On the same text and anchors (block start ``a``: the target has seen ``tok[0..a-1]``), three
figures of the first draft position and beyond:

1. teacher forced on the data (the training metric): the block starts with the data token
   ``tok[a]``; greedy match = draft argmax == target argmax;
2. teacher forced with the block started by the target's own argmax ``y`` at ``a - 1`` (the
   sequence is rerun with ``tok[a] := y``): what the real loop's first round feeds;
3. the real draft -> verify loop (``runner/spec_acceptance.py``), first round only, from the
   prompts ``tok[0..a-1]``; then a longer run (its tau and per-position acceptance).

2 and 3's first position are the same quantity computed by the training and the inference
code: equal figures say the engine drafts what training optimised, so any gap to 1 is the data
(the real loop conditions on the target's own choices, and generated text drifts from the
training distribution), not a bug. Prints a table and writes JSON.

    python scripts/eval/dspark_gap.py [--text-from DIR] [--rows 8] [--len 320] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="v41-small-code")
    ap.add_argument("--text-from", default=None, help="directory of .py files (default: this package, unseen in training)")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--len", type=int, default=320)
    ap.add_argument("--anchors", type=int, nargs="+", default=[96, 160, 224, 288])
    ap.add_argument("--long-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if max(args.anchors) > args.len - 2 or min(args.anchors) < 1:
        raise SystemExit(f"--anchors must lie in [1, --len - 2 = {args.len - 2}]")

    import jax
    import jax.numpy as jnp
    import numpy as np

    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.models.registry import resolve_model
    from deepinfer_jax.models.weights import load_model
    from deepinfer_jax.runner.engram_hash import EngramHasher
    from deepinfer_jax.runner.spec_acceptance import measure_acceptance
    from deepinfer_jax.tokenizer.loader import load_tokenizer
    from deepinfer_jax.training.dspark_forward import dspark_forward
    from deepinfer_jax.training.dspark_loss import dspark_loss
    from deepinfer_jax.training.forward import train_forward

    d = resolve_model(args.model, progress=False)
    cfg = ModelConfig.from_json(d)
    model = load_model(d, cfg)
    tok = load_tokenizer(d, bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id)
    root = args.text_from or os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "deepinfer_jax")
    ids: list[int] = []
    for f in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        with open(f, encoding="utf-8", errors="replace") as fh:
            ids += tok.encode(fh.read())
    if len(ids) < args.len + 1:
        raise SystemExit(f"--text-from {root}: {len(ids)} tokens, need more than {args.len}")
    rng = np.random.default_rng(args.seed)
    starts = rng.integers(0, len(ids) - args.len, size=args.rows)
    T = np.stack([ids[s:s + args.len] for s in starts]).astype(np.int32)
    A = np.tile(np.asarray([args.anchors], np.int32), (args.rows, 1))
    tok_path = os.path.join(d, "tokenizer.json")
    hasher = EngramHasher.from_model_config(cfg, tok_path if os.path.exists(tok_path) else None) if cfg.engram_enabled else None

    def engram(T_BL):
        if hasher is None:
            return None
        return jnp.asarray(np.stack([hasher.hash_positions(row, np.arange(len(row))) for row in T_BL]).astype(np.int32))

    def teacher_forced(T_BL):
        out = dspark_forward(model, jnp.asarray(T_BL), jnp.asarray(A), engram(T_BL))
        _, m = dspark_loss(out.draft_logits, out.confidence, out.target_ids, out.target_logits, out.mask)
        return [float(x) for x in np.asarray(m["greedy_match"])], [float(x) for x in np.asarray(m["accept_rate"])]

    tf_data, tf_accept = teacher_forced(T)
    logits, _, _ = train_forward(model, jnp.asarray(T), engram(T))
    y_BL = np.asarray(jnp.argmax(logits, -1))
    T_y = T.copy()
    for b in range(args.rows):
        for a in A[b]:
            T_y[b, a] = y_BL[b, a - 1]
    tf_y, _ = teacher_forced(T_y)
    data_is_argmax = float(np.mean([T[b, a] == y_BL[b, a - 1] for b in range(args.rows) for a in A[b]]))
    prompts = [[int(t) for t in T[b, :a]] for b in range(args.rows) for a in A[b]]
    first = measure_acceptance(model, prompts, max_new_tokens=2, hasher=hasher, batch_size=len(prompts))
    longer = measure_acceptance(model, prompts, max_new_tokens=args.long_tokens, hasher=hasher, batch_size=len(prompts))
    n = len(prompts)
    first_pos1 = sum(first.accepted_hist[1:]) / max(first.verifications, 1)

    print(f"model {args.model}, {n} anchors ({args.rows} rows x {len(args.anchors)}) of {root}; "
          f"data token == target argmax at {data_is_argmax:.3f} of anchors")
    print(f"{'figure':44} {'pos 1':>6}  per position")
    print(f"{'teacher forced, data token (training)':44} {tf_data[0]:6.3f}  {np.round(tf_data, 3).tolist()}")
    print(f"{'teacher forced, target argmax token':44} {tf_y[0]:6.3f}  {np.round(tf_y, 3).tolist()}")
    print(f"{'real loop, first round':44} {first_pos1:6.3f}  hist {first.accepted_hist}")
    print(f"{'real loop, ' + str(args.long_tokens) + ' tokens (conditional)':44} "
          f"{longer.position_acceptance[0]:6.3f}  {np.round(longer.position_acceptance, 3).tolist()}, tau {longer.tau:.3f}")
    out = args.out or os.path.join("benchmarks", "results", f"dspark_gap_{jax.default_backend()}.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as fh:
        json.dump({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "platform": jax.default_backend(), "jax": jax.__version__, "model": args.model,
                   "args": vars(args), "anchors": n, "data_token_is_argmax": data_is_argmax,
                   "teacher_forced_data_greedy_match": tf_data, "teacher_forced_data_accept_rate": tf_accept,
                   "teacher_forced_argmax_greedy_match": tf_y,
                   "real_first_round_accepted_hist": first.accepted_hist, "real_first_round_pos1": first_pos1,
                   "real_long": longer.summary()}, fh, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
