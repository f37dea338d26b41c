"""Train / held-out split by file. A file is held out when a salted SHA-256 of its path relative
to its root falls below ``fraction``: the rule depends on nothing but the relative path, so it
is the same on every machine, for any walk order and wherever the tree lies, and a held-out file
is never trained on (its exact duplicates are removed before the split, corpus_files.py)."""

from __future__ import annotations

import hashlib

DEFAULT_HELDOUT_FRACTION = 0.02
DEFAULT_SALT = "deepinfer-corpus-v1"


def heldout_score(relpath: str, salt: str = DEFAULT_SALT) -> float:
    """A number in [0, 1), uniform over paths: the first 8 bytes of sha256(salt NUL relpath)."""
    h = hashlib.sha256(f"{salt}\0{relpath}".encode("utf-8")).digest()
    return int.from_bytes(h[:8], "big") / 2.0**64


def is_heldout(relpath: str, fraction: float = DEFAULT_HELDOUT_FRACTION, salt: str = DEFAULT_SALT) -> bool:
    return heldout_score(relpath, salt) < fraction


def split_files(files, fraction: float = DEFAULT_HELDOUT_FRACTION, salt: str = DEFAULT_SALT):
    """``(train, heldout)`` lists of ``files`` (objects with ``relpath``), each in input order."""
    if not 0.0 < fraction < 0.5:
        raise ValueError(f"heldout fraction={fraction}: must be in (0, 0.5)")
    train, heldout = [], []
    for f in files:
        (heldout if is_heldout(f.relpath, fraction, salt) else train).append(f)
    return train, heldout
