#!/usr/bin/env python3
"""DSpark speculative-decoding acceptance of a model, measured with real draft -> verify -> commit
loops outside the engine (``deepinfer_jax/runner/spec_acceptance.py``).

    python scripts/eval/dspark_acceptance.py --preset v41-tiny --random --n-prompts 8 \\
        --prompt-len 32 --max-new-tokens 32                       # smoke run, random weights
    python scripts/eval/dspark_acceptance.py --model DIR --heldout heldout_tokens.npy \\
        --n-prompts 32 --prompt-len 256 --max-new-tokens 128 --temperature 0 1 --out results.json

Prompts: ``--heldout FILE.npy`` (windows of ``--prompt-len`` tokens of a 1-D token array at
seeded offsets), ``--prompts FILE`` (``.jsonl``/``.json``: token-id lists, ``{"token_ids": [...]}``
or ``{"prompt"|"text": "..."}``; any other file: one text prompt per line; text is encoded with
the tokenizer; prompts longer than ``--prompt-len`` keep their last tokens), or, without either,
uniform random token ids (only meaningful for random weights).

Prints one row per temperature: verifications, tau (mean tokens per verification = accepted
drafts + 1), per-position acceptance P(draft i accepted | drafts < i accepted), and the ECE of the
confidence head's predicted cumulative acceptance; writes these (plus histograms, per-position
ECE and the generated tokens) to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def heldout_prompts(path: str, n: int, length: int, seed: int) -> list[list[int]]:
    import numpy as np

    toks = np.load(path, mmap_mode="r")
    if toks.ndim != 1:
        raise SystemExit(f"--heldout {path}: expected a 1-D token array, got shape {toks.shape}")
    if len(toks) < length + 1:
        raise SystemExit(f"--heldout {path}: {len(toks)} tokens < --prompt-len {length}")
    offs = np.random.default_rng(seed).integers(0, len(toks) - length, size=n)
    return [[int(t) for t in toks[o:o + length]] for o in offs]


def file_prompts(path: str, tokenizer, n: int, length: int) -> list[list[int]]:
    def encode(text: str) -> list[int]:
        if tokenizer is None:
            raise SystemExit(f"--prompts {path}: text prompts need a tokenizer (--tokenizer or the model's)")
        return tokenizer.encode(text)

    items = []
    with open(path) as f:
        if path.endswith(".json"):
            items = json.load(f)
        elif path.endswith(".jsonl"):
            items = [json.loads(line) for line in f if line.strip()]
        else:
            items = [line.rstrip("\n") for line in f if line.strip()]
    out = []
    for it in items:
        if isinstance(it, dict):
            it = it.get("token_ids", it.get("prompt", it.get("text")))
        ids = encode(it) if isinstance(it, str) else [int(t) for t in it]
        if ids:
            out.append(ids[-length:])
    if not out:
        raise SystemExit(f"--prompts {path}: no prompts")
    return out[:n]


def tokenizer_json(path: str | None) -> str | None:
    if path is None:
        return None
    p = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    return p if os.path.isfile(p) else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="model directory (config.json + safetensors, or Orbax)")
    src.add_argument("--preset", help="a config preset (with --random): e.g. v41-tiny")
    ap.add_argument("--random", action="store_true", help="random weights for --preset (smoke run)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer.json or its directory (default: the model's)")
    pr = ap.add_mutually_exclusive_group()
    pr.add_argument("--prompts", default=None, help="prompt file (.jsonl/.json token ids or text; else text lines)")
    pr.add_argument("--heldout", default=None, help="1-D token array (.npy); prompts are windows at seeded offsets")
    ap.add_argument("--n-prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=None, help="prompts per step (slots; default min(n, 32))")
    ap.add_argument("--step-tokens", type=int, default=256, help="padded tokens per step (prefill chunk)")
    ap.add_argument("--ece-bins", type=int, default=10)
    ap.add_argument("--trace", action="store_true",
                    help="also write the per-verification predicted / observed cumulative acceptance "
                         "(the trace scripts/dspark_sim.py replays)")
    ap.add_argument("--out", default=None, help="JSON results path")
    a = ap.parse_args(argv)

    import jax
    import numpy as np
    from tqdm.auto import tqdm

    from deepinfer_jax.models.weights import load_model
    from deepinfer_jax.runner.engram_hash import EngramHasher
    from deepinfer_jax.runner.spec_acceptance import measure_acceptance

    if a.preset is not None:
        if not a.random:
            raise SystemExit("--preset needs --random (a preset has no weights)")
        from deepinfer_jax.checkpoint.random_checkpoint import write_random_checkpoint
        from deepinfer_jax.config import preset

        model_dir = tempfile.mkdtemp(prefix=f"{a.preset}_random_")
        write_random_checkpoint(preset(a.preset), model_dir, seed=a.seed, progress=False)
    else:
        model_dir = a.model
    model = load_model(model_dir, progress=a.preset is None)
    cfg = model.cfg
    tok_path = tokenizer_json(a.tokenizer or model_dir)
    hasher = EngramHasher.from_model_config(cfg, tok_path) if cfg.engram_enabled else None
    if cfg.engram_enabled and tok_path is None:
        print("warning: Engram model without a tokenizer.json: the hasher uses the identity token map",
              file=sys.stderr)

    if a.heldout:
        prompts = heldout_prompts(a.heldout, a.n_prompts, a.prompt_len, a.seed)
    elif a.prompts:
        tok = None
        if tok_path is not None:
            from deepinfer_jax.tokenizer.loader import load_tokenizer

            tok = load_tokenizer(os.path.dirname(tok_path))
        prompts = file_prompts(a.prompts, tok, a.n_prompts, a.prompt_len)
    else:
        rng = np.random.default_rng(a.seed)
        hi = cfg.vocab_size - 1  # no DSpark noise id
        prompts = [rng.integers(3, hi, size=a.prompt_len).tolist() for _ in range(a.n_prompts)]

    results = []
    for T in a.temperature:
        t0 = time.time()
        with tqdm(total=len(prompts) * a.max_new_tokens, desc=f"T={T:g}", unit="tok") as bar:
            rep = measure_acceptance(model, prompts, a.max_new_tokens, temperature=T, seed=a.seed, hasher=hasher,
                                     batch_size=a.batch_size, step_tokens=a.step_tokens, progress=bar.update)
        s = rep.summary(a.ece_bins, trace=a.trace)
        s["wall_s"] = time.time() - t0
        s["tokens"] = rep.tokens
        results.append(s)

    blk = cfg.dspark_block_size
    head = f"{'T':>5} {'verif':>7} {'tau':>6}  " + " ".join(f"{'acc' + str(i + 1):>6}" for i in range(blk)) + \
           f"  {'ECE':>6}  " + " ".join(f"{'ece' + str(i + 1):>6}" for i in range(blk))
    print(head)
    for s in results:
        print(f"{s['temperature']:>5g} {s['verifications']:>7d} {s['tau']:>6.3f}  "
              + " ".join(f"{x:>6.3f}" for x in s["position_acceptance"]) + f"  {s['ece']:>6.3f}  "
              + " ".join(f"{x:>6.3f}" for x in s["ece_per_position"]))
    if a.out:
        meta = dict(model=a.model or f"{a.preset} (random, seed {a.seed})", prompts=a.heldout or a.prompts or "random",
                    n_prompts=len(prompts), prompt_lens=[len(p) for p in prompts], max_new_tokens=a.max_new_tokens,
                    seed=a.seed, block_size=blk, device=str(jax.devices()[0]),
                    date=datetime.datetime.now().isoformat(timespec="seconds"))
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        def clean(x):  # NaN (a position never reached) -> null
            if isinstance(x, float) and x != x:
                return None
            if isinstance(x, dict):
                return {k: clean(v) for k, v in x.items()}
            if isinstance(x, list):
                return [clean(v) for v in x]
            return x

        with open(a.out, "w") as f:
            json.dump(clean(dict(meta=meta, results=results)), f, indent=1)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
