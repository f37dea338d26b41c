#!/usr/bin/env python3
"""How much of the model's greedy text is a loop, and how well the DSpark stages draft there.

Prompts of ``--prompt-len`` tokens are cut from ``.py`` files (default: this package, never
trained on), continued greedily by the engine for ``--new`` tokens; then, teacher forced on those
continuations, the draft's greedy match with the target's argmax at every block position, split
by whether the anchor sits in a loop (``training/repeat_tail.loop_mask``: the last
``max(2P, 8)`` tokens repeat with a period ``P <= 64``). The target continues its own loops by
construction, so a draft that copies them would match there at every position. Prints a table and
writes JSON.

    python scripts/eval/dspark_loops.py [--model v41-small-code] [--rows 16] [--new 128] [--out FILE]
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
    ap.add_argument("--text-from", default=None, help="directory of .py files (default: this package)")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    for f in ("rows", "prompt_len", "new"):
        if getattr(args, f) < 1:
            raise SystemExit(f"--{f.replace('_', '-')}={getattr(args, f)}: must be >= 1")

    import jax
    import jax.numpy as jnp
    import numpy as np

    from deepinfer_jax import LLM, SamplingParams
    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.models.registry import resolve_model
    from deepinfer_jax.models.weights import load_model
    from deepinfer_jax.runner.engram_hash import EngramHasher
    from deepinfer_jax.tokenizer.loader import load_tokenizer
    from deepinfer_jax.training.dspark_forward import dspark_forward
    from deepinfer_jax.training.repeat_tail import loop_mask

    d = resolve_model(args.model, progress=False)
    cfg = ModelConfig.from_json(d)
    blk = cfg.dspark_block_size
    if not cfg.dspark_enabled:
        raise SystemExit(f"--model {args.model}: no DSpark stages")
    if args.new <= blk + 1:
        raise SystemExit(f"--new={args.new}: must exceed the block size + 1 ({blk + 1})")
    tok = load_tokenizer(d, bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id)
    root = os.path.normpath(args.text_from or os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                                           "deepinfer_jax"))
    rng = np.random.default_rng(args.seed)
    prompts = []
    files = sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True))
    for f in rng.permutation(files):
        with open(f, encoding="utf-8", errors="replace") as fh:
            ids = tok.encode(fh.read())
        if len(ids) > args.prompt_len:
            s = int(rng.integers(0, len(ids) - args.prompt_len + 1))
            prompts.append(ids[s:s + args.prompt_len])
        if len(prompts) == args.rows:
            break
    if len(prompts) < args.rows:
        raise SystemExit(f"--text-from {root}: {len(prompts)} files longer than {args.prompt_len} tokens, need {args.rows}")

    llm = LLM(model=d, max_num_seqs=args.rows)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=args.new, ignore_eos=True), use_tqdm=False)
    del llm
    seqs = np.asarray([p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)], np.int32)
    model = load_model(d, cfg)
    eng = None
    if cfg.engram_enabled:
        tp = os.path.join(d, "tokenizer.json")
        hasher = EngramHasher.from_model_config(cfg, tp if os.path.exists(tp) else None)
        eng = jnp.asarray(np.stack([hasher.hash_positions(r, np.arange(len(r))) for r in seqs]).astype(np.int32))
    # anchors: every block start in the continuation whose whole block has a target (a + blk <= L - 1)
    L = seqs.shape[1]
    A = np.tile(np.arange(args.prompt_len, L - blk)[None], (len(seqs), 1)).astype(np.int32)
    out = dspark_forward(model, jnp.asarray(seqs), jnp.asarray(A), eng)
    match = np.asarray(jnp.argmax(out.draft_logits, -1) == jnp.argmax(out.target_logits, -1))   # [B, A, K]
    # the anchor a: the target has seen up to a - 1, so the loop is judged on tokens up to a
    loop = np.stack([loop_mask(r)[a] for r, a in zip(seqs, A)])
    res = {"loop_share": float(loop.mean()), "anchors": int(loop.size),
           "match_in_loops": [round(float(x), 4) for x in match[loop].mean(0)] if loop.any() else [],
           "match_elsewhere": [round(float(x), 4) for x in match[~loop].mean(0)] if (~loop).any() else []}
    print(f"model {args.model}: {args.rows} prompts of {args.prompt_len} tokens from {root}, {args.new} greedy tokens each")
    print(f"anchors in a loop: {res['loop_share']:.3f} of {res['anchors']}")
    print(f"{'draft == target argmax':24} " + " ".join(f"pos {i + 1:>2}" for i in range(blk)))
    for name, key in (("in loops", "match_in_loops"), ("elsewhere", "match_elsewhere")):
        if res[key]:
            print(f"{name:24} " + " ".join(f"{x:6.3f}" for x in res[key]))
    path = args.out or os.path.join("benchmarks", "results", f"dspark_loops_{jax.default_backend()}.json")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as fh:
        json.dump({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "platform": jax.default_backend(), "jax": jax.__version__, "args": vars(args)} | res, fh, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
