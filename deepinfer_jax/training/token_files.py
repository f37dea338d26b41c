"""Token files: the documents of a split encoded and written as one flat ``.npy`` of token ids,
each document followed by ``<eos>`` (so the documents of the array are its ``<eos>``-separated
runs, and no window of training data runs from one file into the next unmarked). ``uint16``
while the vocabulary fits, else ``int32``. Encoding runs in batches of about ``batch_bytes``
with ``tokenizers``' parallel ``encode_batch``, so memory stays bounded on large corpora.

Special-token strings inside a document (source that mentions ``"<eos>"``) are encoded as the
plain text they are, never as the special ids: the only special ids in a token file are the
document ends."""

from __future__ import annotations

import os

import numpy as np


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.int32)


def _batches(texts, batch_bytes: int):
    batch, size = [], 0
    for t in texts:
        batch.append(t)
        size += len(t)
        if size >= batch_bytes:
            yield batch, size
            batch, size = [], 0
    if batch:
        yield batch, size


def encode_documents(tok, texts, eos_id: int, batch_bytes: int = 8 << 20, progress: bool = False,
                     desc: str = "encode") -> np.ndarray:
    """Ids of ``texts`` (a list of strings), each followed by ``eos_id``, as one 1-D array."""
    vocab = tok.get_vocab_size(with_added_tokens=True)
    dtype = token_dtype(vocab)
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # _fast: no offsets computed
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=sum(len(t) for t in texts), unit="char", unit_scale=True, desc=desc)
    parts = []
    eos = np.array([eos_id], dtype=dtype)
    was = tok.encode_special_tokens
    tok.encode_special_tokens = True  # "<eos>" in the text is text
    try:
        for batch, size in _batches(texts, batch_bytes):
            for enc in encode(batch, add_special_tokens=False):
                parts.append(np.asarray(enc.ids, dtype=dtype))
                parts.append(eos)
            if bar is not None:
                bar.update(size)
    finally:
        tok.encode_special_tokens = was
        if bar is not None:
            bar.close()
    return np.concatenate(parts) if parts else np.zeros((0,), dtype)


def write_tokens(path: str | os.PathLike, ids: np.ndarray) -> None:
    np.save(os.fspath(path), ids, allow_pickle=False)


def split_documents(ids: np.ndarray, eos_id: int) -> list[np.ndarray]:
    """The documents of a token file: the runs before each ``eos_id`` (the trailing one included)."""
    ends = np.flatnonzero(ids == eos_id)
    starts = np.concatenate([[0], ends[:-1] + 1]) if len(ends) else np.zeros((0,), np.int64)
    return [ids[s:e] for s, e in zip(starts, ends)]
