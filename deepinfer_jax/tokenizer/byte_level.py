"""Byte tables of byte-level BPE tokenizers: a token's exact bytes, for fast streaming decode.

A byte-level decoder (GPT-2's ``ByteLevel``, used by DeepSeek's tokenizers and the shipped
model's) maps every character of each token string back to one byte (a token whose string holds
a character outside that map contributes its UTF-8 bytes instead), concatenates the bytes and
decodes them as UTF-8, each invalid sequence becoming U+FFFD. The text of ids is therefore
``b"".join(table[i] for i in ids).decode("utf-8", "replace")``, where ``table`` is built once
per tokenizer. ``IncrementalDetokenizer`` uses it to emit each token's text with no call into
the tokenizer (per-token host work on the engine's results path).

``token_byte_tables`` returns ``None`` unless the tokenizer's decoder is a plain ``ByteLevel``
and the table reproduces ``tokenizer.decode`` on a fixed sample of id sequences (both
``skip_special_tokens`` settings); callers then keep the tokenizer's own decode.

This module must not import JAX.
"""

from __future__ import annotations

import json
import random

__all__ = ["bytes_to_unicode", "token_byte_tables"]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the byte-level alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def _decoder_is_byte_level(tokenizer) -> bool:
    try:
        dec = json.loads(tokenizer.to_str()).get("decoder")
    except Exception:  # noqa: BLE001 - an unreadable tokenizer: no fast path
        return False
    return isinstance(dec, dict) and dec.get("type") == "ByteLevel"


def token_byte_tables(info, num_ids: int | None = None, sample_sequences: int = 48,
                      sample_len: int = 24) -> tuple[list[bytes], list[bytes]] | None:
    """``(table, table_skipping_specials)``: each id's bytes (``b""`` for ids outside the
    vocabulary, and in the second table for ``info.all_special_ids``), for ids below
    ``num_ids`` (default the tokenizer's vocabulary size); ``None`` when the tokenizer is not
    byte-level or the tables disagree with its decode on the check sample."""
    tok = info.tokenizer
    if not _decoder_is_byte_level(tok):
        return None
    n = int(num_ids if num_ids is not None else info.vocab_size)
    char_byte = {c: b for b, c in bytes_to_unicode().items()}
    keep: list[bytes] = []
    for i in range(n):
        s = tok.id_to_token(i)
        if s is None:
            keep.append(b"")
            continue
        try:
            keep.append(bytes(char_byte[c] for c in s))
        except KeyError:  # a character outside the byte alphabet (e.g. an added token's text)
            keep.append(s.encode("utf-8"))
    skip = [b"" if i in info.all_special_ids else b for i, b in enumerate(keep)]
    # check against the tokenizer itself: random sequences of every id, specials included
    rng = random.Random(0)
    hi = max(n, 1)
    specials = sorted(i for i in info.all_special_ids if i < n)
    for k in range(sample_sequences):
        ids = [rng.randrange(hi) for _ in range(sample_len)]
        if specials and k % 2:
            ids[rng.randrange(sample_len)] = rng.choice(specials)
        for table, skip_special in ((keep, False), (skip, True)):
            want = info.decode(ids, skip_special_tokens=skip_special)
            if b"".join(table[i] for i in ids).decode("utf-8", "replace") != want:
                return None
    return keep, skip
