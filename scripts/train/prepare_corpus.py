#!/usr/bin/env python
"""Prepare the training corpus of a small V4.1-architecture model from the Python sources of
this machine, in one command:

    python scripts/train/prepare_corpus.py --out DIR [--roots R1 R2 ...] [--vocab-size 8192] \
        [--heldout-fraction 0.02] [--docs] [--max-file-bytes 1000000] [--salt S] [--no-progress]

``--roots`` default: this interpreter's stdlib, purelib and platlib. ``--docs`` adds .rst/.txt/.md
files to the .py files. Writes into DIR: tokenizer.json (+ tokenizer_config.json,
tokenizer_ids.json), train.npy and heldout.npy (token ids, each file followed by <eos>; feed
train.npy to ``scripts/train/train.py --data``), heldout_files.txt (commit it), train_files.txt,
corpus_stats.json (counts, bytes per token, skipped files, gzip/xz bits per byte of the held-out
bytes). Then loads DIR with the engine's tokenizer loader and checks that the first held-out
files decode to their text.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

# The repository root first, so the checkout this script is in is what runs (as scripts/*.py do).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from deepinfer_jax.tokenizer import load_tokenizer  # noqa: E402
from deepinfer_jax.training import bpe_tokenizer as B  # noqa: E402
from deepinfer_jax.training import corpus_split, token_files  # noqa: E402
from deepinfer_jax.training.corpus import prepare_corpus  # noqa: E402
from deepinfer_jax.training.corpus_files import DEFAULT_MAX_FILE_BYTES  # noqa: E402


def _check_with_engine_loader(out: str, n_docs: int = 20) -> int:
    """Decode the first ``n_docs`` held-out documents with the engine's loader; the number checked."""
    info = load_tokenizer(out)
    ids = np.load(os.path.join(out, "heldout.npy"), mmap_mode="r")
    with open(os.path.join(out, "heldout_files.txt"), encoding="utf-8") as f:
        names = [line.rstrip("\n") for line in f]
    docs = token_files.split_documents(np.asarray(ids), info.eos_token_id)
    if len(docs) != len(names):
        raise SystemExit(f"heldout.npy holds {len(docs)} documents, heldout_files.txt names {len(names)}")
    stats = json.load(open(os.path.join(out, "corpus_stats.json")))
    roots = stats["roots"]
    checked = 0
    for name, doc in zip(names[:n_docs], docs):
        for root in roots:  # the file's root is the first that has it (the collector's order)
            path = os.path.join(root, name)
            if os.path.isfile(path):
                break
        text = open(path, encoding="utf-8").read()
        if info.decode(doc.tolist(), skip_special_tokens=False) != text:
            raise SystemExit(f"engine loader: held-out document {name!r} does not decode to its file")
        checked += 1
    return checked


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--roots", nargs="+", default=None)
    ap.add_argument("--vocab-size", type=int, default=B.DEFAULT_VOCAB_SIZE,
                    help=f"{B.VOCAB_RANGE[0]}..{B.VOCAB_RANGE[1]}")
    ap.add_argument("--heldout-fraction", type=float, default=corpus_split.DEFAULT_HELDOUT_FRACTION)
    ap.add_argument("--docs", action="store_true", help="also .rst/.txt/.md files")
    ap.add_argument("--max-file-bytes", type=int, default=DEFAULT_MAX_FILE_BYTES)
    ap.add_argument("--salt", default=corpus_split.DEFAULT_SALT, help="of the held-out hash")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)

    lo, hi = B.VOCAB_RANGE
    if not lo <= a.vocab_size <= hi:
        ap.error(f"--vocab-size={a.vocab_size}: must be in [{lo}, {hi}]")
    if not 0.0 < a.heldout_fraction < 0.5:
        ap.error(f"--heldout-fraction={a.heldout_fraction}: must be in (0, 0.5)")
    if a.max_file_bytes <= 0:
        ap.error(f"--max-file-bytes={a.max_file_bytes}: must be > 0")
    for r in a.roots or ():
        if not os.path.isdir(r):
            ap.error(f"--roots: {r!r} is not a directory")

    t = time.monotonic()
    stats = prepare_corpus(a.out, a.roots, a.vocab_size, a.heldout_fraction, a.docs, a.max_file_bytes,
                           a.salt, progress=not a.no_progress)
    checked = _check_with_engine_loader(a.out)
    wall = time.monotonic() - t
    s, b = stats["splits"], stats["heldout_baselines"]
    print(f"wall {wall:.1f} s ({stats['times']}); {s['train']['files']} train files "
          f"({s['train']['bytes']} B, {s['train']['tokens']} tokens), {s['heldout']['files']} held out "
          f"({s['heldout']['bytes']} B, {s['heldout']['tokens']} tokens); "
          f"{s['train']['bytes_per_token']:.3f} B/token; vocab {stats['tokenizer']['vocab_size']}; "
          f"skipped {stats['skipped_files']}")
    print(f"held-out bits per byte: gzip -9 {b['gzip_bpb']:.4f}, xz -9e {b['xz_bpb']:.4f}, "
          f"target <= {b['target_bpb']:.4f}; engine loader decoded {checked} held-out files exactly")
    return 0


if __name__ == "__main__":
    sys.exit(main())
