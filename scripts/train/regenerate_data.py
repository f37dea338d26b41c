#!/usr/bin/env python
"""DSpark training data written by the target model: prompts cut from the corpus's training split,
each continued by the model (``deepinfer_jax/runner/regenerate.py``), as a stack of sequences
``[prompt | continuation]`` for ``scripts/train/train_dspark.py --sequences --anchor-low P``.

    python scripts/train/regenerate_data.py --out runs/regen [--model DIR] [--roots R ...] \\
        [--sequences 2048] [--prompt-len 256] [--new-tokens 768] [--batch-size 512] \\
        [--temperature 0 0 0 1] [--time-budget S] [--check-heldout heldout_files.txt] [--heldout]

``--model``: default the shipped model. The files are those ``prepare_corpus.py`` reads (same
roots, filters and salted split), encoded with the model's tokenizer; only training-split files
give prompts. ``--check-heldout``: a committed held-out list (``heldout_files.txt``) that this
machine's split must reproduce exactly (so no held-out file is trained on). ``--temperature``:
successive groups of ``--batch-size`` sequences cycle through these (0 = greedy). ``--heldout`` also writes
``heldout.npy``: the held-out files encoded as ``prepare_corpus.py`` does (what
``scripts/eval/dspark_acceptance.py --heldout`` cuts its prompts from).

Writes into ``--out``: ``regen.npy`` (uint16, ``sequences * (prompt-len + new-tokens)`` ids),
``regen_meta.json`` (settings, counts, timings). ``--train-split`` also writes ``train.npy``, the
whole training split in the model's tokenizer (``--sequences 0``: that alone, no generation).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from deepinfer_jax.models.registry import DEFAULT_MODEL, SHIPPED  # noqa: E402
from deepinfer_jax.training import corpus_files, corpus_split, token_files  # noqa: E402
from deepinfer_jax.runner.regenerate import continue_prompts, prompt_windows  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the shipped model)")
    ap.add_argument("--roots", nargs="+", default=None, help="default: this interpreter's stdlib and site-packages")
    ap.add_argument("--salt", default=corpus_split.DEFAULT_SALT)
    ap.add_argument("--heldout-fraction", type=float, default=corpus_split.DEFAULT_HELDOUT_FRACTION)
    ap.add_argument("--check-heldout", default=None, help="committed heldout_files.txt the split must equal")
    ap.add_argument("--sequences", type=int, default=2048)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=768)
    ap.add_argument("--batch-size", type=int, default=512, help="sequences per step")
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0],
                    help="temperatures of successive groups of --batch-size sequences, cycled (0 = greedy)")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds of generation; no new group starts after it (fewer sequences)")
    ap.add_argument("--max-files", type=int, default=8000, help="training files sampled for prompts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--heldout", action="store_true", help="also write heldout.npy")
    ap.add_argument("--train-split", action="store_true",
                    help="also write train.npy: the whole training split encoded with the model's tokenizer "
                         "(real text for train_dspark.py); with --sequences 0 nothing is generated")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    if a.sequences < (0 if a.train_split or a.heldout else 1):
        raise SystemExit(f"--sequences={a.sequences}: must be >= 1 (>= 0 with --train-split or --heldout)")
    for name in ("prompt_len", "new_tokens", "batch_size", "max_files"):
        if getattr(a, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}={getattr(a, name)}: must be >= 1")
    if any(t < 0 for t in a.temperature):
        raise SystemExit(f"--temperature={a.temperature}: must be >= 0")

    import tokenizers
    from tqdm.auto import tqdm

    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.models.weights import load_model
    from deepinfer_jax.runner.engram_hash import EngramHasher

    model_dir = os.fspath(a.model or SHIPPED[DEFAULT_MODEL])
    tok_json = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(tok_json):
        raise SystemExit(f"--model={model_dir!r}: no tokenizer.json")
    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()
    roots = corpus_files.unique_roots(a.roots or corpus_files.default_roots())
    files, _, _ = corpus_files.collect_files(roots, progress=not a.no_progress)
    train, heldout = corpus_split.split_files(files, a.heldout_fraction, a.salt)
    if a.check_heldout:
        with open(a.check_heldout) as f:
            want = [ln.rstrip("\n") for ln in f if ln.strip()]
        if sorted(want) != sorted(h.relpath for h in heldout):
            raise SystemExit(f"--check-heldout {a.check_heldout}: this machine's held-out split ({len(heldout)} files) "
                             f"differs from the committed list ({len(want)} files); refusing to generate")
        print(f"held-out split equals {a.check_heldout} ({len(want)} files)")
    rng = np.random.default_rng(a.seed)
    pick = rng.choice(len(train), size=min(a.max_files, len(train)), replace=False) if a.sequences else []
    tok = tokenizers.Tokenizer.from_file(tok_json)
    # the model and the prompts only when something is generated (--sequences 0: encoding alone)
    model = load_model(model_dir, progress=False) if a.sequences else None
    cfg = model.cfg if model is not None else ModelConfig.from_json(model_dir)
    if a.sequences:
        ids = token_files.encode_documents(tok, [train[i].text for i in pick], cfg.eos_token_id)
        prompts = prompt_windows(token_files.split_documents(ids, cfg.eos_token_id), a.sequences, a.prompt_len, a.seed)
    t_data = time.time() - t0
    split_meta = {}
    if a.train_split:
        ts = time.time()
        t_ids = token_files.encode_documents(tok, [f.text for f in train], cfg.eos_token_id,
                                             progress=not a.no_progress, desc="encode train split")
        token_files.write_tokens(os.path.join(a.out, "train.npy"), t_ids)
        split_meta = {"train_tokens": int(len(t_ids)), "train_bytes": int(sum(len(f.text.encode()) for f in train)),
                      "train_encode_s": round(time.time() - ts, 2)}
        print(json.dumps(split_meta))

    hasher = EngramHasher.from_model_config(cfg, tok_json) if cfg.engram_enabled else None
    banned = sorted({cfg.pad_token_id, cfg.dspark_noise_token_id} if cfg.dspark_enabled else {cfg.pad_token_id})
    parts, per_temp = [], {}
    t1 = time.time()
    groups = range(0, a.sequences, a.batch_size)
    with tqdm(total=a.sequences * a.new_tokens, unit="tok", desc="generate", disable=a.no_progress) as bar:
        for gi, g0 in enumerate(groups):
            if a.time_budget and gi and time.time() - t1 > a.time_budget:
                print(f"--time-budget {a.time_budget:g} s spent: {g0} of {a.sequences} sequences generated")
                break
            T = a.temperature[gi % len(a.temperature)]
            ts = time.time()
            seqs = continue_prompts(model, prompts[g0:g0 + a.batch_size], a.new_tokens, batch_size=a.batch_size,
                                    temperature=T, seed=a.seed + gi, hasher=hasher, banned_ids=banned,
                                    progress=bar.update)
            parts.append(seqs)
            cont = seqs[:, a.prompt_len:]
            st = per_temp.setdefault(T, {"temperature": T, "sequences": 0, "seconds": 0.0, "eos": 0, "distinct": 0.0})
            st["sequences"] += len(seqs)
            st["seconds"] += time.time() - ts
            st["eos"] += int(np.sum(cont == cfg.eos_token_id))
            st["distinct"] += float(sum(len(np.unique(r)) / len(r) for r in cont))
    per_temp = [{"temperature": st["temperature"], "sequences": st["sequences"], "seconds": round(st["seconds"], 2),
                 "eos_share": st["eos"] / (st["sequences"] * a.new_tokens),
                 "distinct_token_share": st["distinct"] / st["sequences"]} for st in per_temp.values()]
    t_gen = time.time() - t1
    seqs = np.concatenate(parts) if parts else np.zeros((0, a.prompt_len + a.new_tokens), np.int64)
    if len(seqs):
        token_files.write_tokens(os.path.join(a.out, "regen.npy"),
                                 seqs.reshape(-1).astype(token_files.token_dtype(cfg.vocab_size)))
    meta = {"model": model_dir, "roots": roots, "split_salt": a.salt,
            "heldout_fraction": a.heldout_fraction, "train_files": len(train), "heldout_files": len(heldout),
            "prompt_files_sampled": int(len(pick)), "sequences": int(len(seqs)), "prompt_len": a.prompt_len,
            "new_tokens": a.new_tokens, "seq_len": a.prompt_len + a.new_tokens, "banned_ids": banned,
            "per_temperature": per_temp, "generated_tokens": int(len(seqs) * a.new_tokens),
            "generate_s": round(t_gen, 2),
            "generated_tokens_per_s": round(len(seqs) * a.new_tokens / t_gen, 1) if len(seqs) else None,
            "data_s": round(t_data, 2), "seed": a.seed, "checked_heldout_list": a.check_heldout,
            "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **split_meta}
    if a.heldout:
        h_ids = token_files.encode_documents(tok, [h.text for h in heldout], cfg.eos_token_id)
        token_files.write_tokens(os.path.join(a.out, "heldout.npy"), h_ids)
        meta["heldout_tokens"] = int(len(h_ids))
    with open(os.path.join(a.out, "regen_meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(json.dumps({k: meta[k] for k in ("sequences", "generated_tokens", "generate_s", "generated_tokens_per_s",
                                           "per_temperature")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
