"""Prepare a training corpus in one call: collect the source files of some roots
(corpus_files.py), split them by file into train / held-out (corpus_split.py), train a
byte-level BPE tokenizer on the train split only (bpe_tokenizer.py), encode both splits to token
files (token_files.py), and measure the gzip / xz bits per byte of the held-out bytes
(compression_baseline.py), the baselines the trained model is judged against.

``prepare_corpus(out_dir, ...)`` writes into ``out_dir``:

* ``tokenizer.json``, ``tokenizer_config.json``, ``tokenizer_ids.json``: the tokenizer;
* ``train.npy``, ``heldout.npy``: token ids, each document followed by ``<eos>``;
* ``heldout_files.txt``, ``train_files.txt``: relative paths, one per line, in the order of the
  token files (the held-out list is small and meant to be committed);
* ``corpus_stats.json``: files / bytes / tokens per split, bytes per token, skipped files by
  reason, the tokenizer's vocab size, the roots, Python version, date, phase times, and the
  compression baselines of the held-out bytes (all held-out files concatenated in list order,
  no separators)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
import time

from deepinfer_jax.training import bpe_tokenizer as B
from deepinfer_jax.training import compression_baseline, corpus_files, corpus_split, token_files

# The quality target of issue 12: the model's held-out bits per byte at most this times xz's.
TARGET_XZ_RATIO = 0.7


def _split_stats(files, ids, eos_id: int) -> dict:
    n_bytes = sum(f.n_bytes for f in files)
    n_content = int(len(ids)) - len(files)  # tokens without the one <eos> per document
    return {"files": len(files), "bytes": n_bytes, "tokens": int(len(ids)), "eos_tokens": len(files),
            "bytes_per_token": (n_bytes / n_content) if n_content else None}


def _write_list(path: str, files) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(sf.relpath + "\n" for sf in files)


def prepare_corpus(out_dir: str | os.PathLike, roots=None, vocab_size: int = B.DEFAULT_VOCAB_SIZE,
                   heldout_fraction: float = corpus_split.DEFAULT_HELDOUT_FRACTION,
                   include_docs: bool = False, max_file_bytes: int = corpus_files.DEFAULT_MAX_FILE_BYTES,
                   salt: str = corpus_split.DEFAULT_SALT, vocab_range: tuple[int, int] = B.VOCAB_RANGE,
                   progress: bool = True) -> dict:
    """Do it all (see the module docstring); returns the stats written to ``corpus_stats.json``."""
    B.check_vocab_size(vocab_size, vocab_range)  # fail before the slow parts
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    roots = corpus_files.unique_roots(roots if roots else corpus_files.default_roots())
    times = {}

    t = time.monotonic()
    files, skipped, skipped_dirs = corpus_files.collect_files(roots, include_docs, max_file_bytes, progress)
    times["collect_s"] = time.monotonic() - t
    if not files:
        raise ValueError(f"roots {roots}: no files kept (skipped: {skipped})")

    train, heldout = corpus_split.split_files(files, heldout_fraction, salt)
    if not train or not heldout:
        raise ValueError(f"split of {len(files)} files at heldout fraction={heldout_fraction}: "
                         f"{len(train)} train, {len(heldout)} held out; both must be non-empty")
    _write_list(os.path.join(out_dir, "heldout_files.txt"), heldout)
    _write_list(os.path.join(out_dir, "train_files.txt"), train)

    t = time.monotonic()
    texts = [f.text for f in train]
    tok = B.train_bpe(texts, vocab_size, vocab_range, show_progress=progress, length=len(texts))
    ids_info = B.save_tokenizer(tok, out_dir)
    times["tokenizer_s"] = time.monotonic() - t

    t = time.monotonic()
    eos = ids_info["eos_token_id"]
    split_stats = {}
    for name, part in (("train", train), ("heldout", heldout)):
        ids = token_files.encode_documents(tok, [f.text for f in part], eos, progress=progress, desc=name)
        token_files.write_tokens(os.path.join(out_dir, f"{name}.npy"), ids)
        split_stats[name] = {**_split_stats(part, ids, eos), "dtype": str(ids.dtype)}
    times["encode_s"] = time.monotonic() - t

    t = time.monotonic()
    base = compression_baseline.compression_bpb(b"".join(f.text.encode("utf-8") for f in heldout))
    times["baseline_s"] = time.monotonic() - t
    base["target_bpb"] = TARGET_XZ_RATIO * base["xz_bpb"]
    base["target_rule"] = f"model held-out bits per byte <= {TARGET_XZ_RATIO} x xz_bpb on these bytes"

    stats = {
        "roots": roots,
        "include_docs": include_docs,
        "max_file_bytes": max_file_bytes,
        "heldout_fraction": heldout_fraction,
        "split_salt": salt,
        "splits": split_stats,
        "skipped_files": skipped,
        "skipped_dirs": skipped_dirs,
        "tokenizer": ids_info,
        "requested_vocab_size": vocab_size,
        "heldout_baselines": base,
        "python": sys.version,
        "python_implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "times": {k: round(v, 3) for k, v in times.items()},
    }
    with open(os.path.join(out_dir, "corpus_stats.json"), "w") as f:
        json.dump(stats, f, indent=1)
    return stats
