"""A minimal jitted driver of the model for a few sequences: prefill (optionally in chunks), greedy
decode, DSpark drafts. Used by the demo command, the golden tests and anyone who wants the
model without the engine. The engine (``engine/``, ``runner/``) does the same at scale.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from deepinfer_jax.base import batch_invariant as bi
from deepinfer_jax.models.cache import CacheConfig, allocate_cache
from deepinfer_jax.runner.engram_hash import EngramHasher
from deepinfer_jax.base.forward_batch import RowSpec, build_batch, pack_batch


@functools.partial(jax.jit, static_argnames=("graphdef", "with_taps", "batch_invariant"), donate_argnames=("cache",))
def _step(graphdef, state, cache, batch, with_taps: bool, batch_invariant: bool = False):
    model = nnx.merge(graphdef, state)
    taps = {} if with_taps else None
    with bi.use(batch_invariant):
        cache, logits, main_hidden = model(cache, batch, taps)
    return cache, logits, main_hidden, taps


@functools.partial(jax.jit, static_argnames=("graphdef", "with_taps", "batch_invariant"))
def _draft(graphdef, state, cache, ids, last_pos, slots, with_taps: bool, batch_invariant: bool = False):
    model = nnx.merge(graphdef, state)
    taps = {} if with_taps else None
    with bi.use(batch_invariant):
        out = model.draft(cache, ids, last_pos, slots, taps)
    return out.token_ids, out.logits, out.confidence, taps


class SequenceDriver:
    """Holds a model, its cache and each sequence's token history (one SWA slot per sequence).
    ``batch_invariant``: run the steps in batch-invariant mode (``base/batch_invariant.py``)."""

    def __init__(self, model, cache_config: CacheConfig, hasher: EngramHasher | None = None,
                 batch_invariant: bool = False):
        self.cfg = model.cfg
        self.batch_invariant = bool(batch_invariant)
        self.graphdef, self.state = nnx.split(model)
        self.cc = cache_config.validate(self.cfg)
        self.cache = allocate_cache(self.cfg, self.cc)
        if self.cfg.engram_enabled and hasher is None:
            hasher = EngramHasher.from_model_config(self.cfg)
        self.hasher = hasher
        self.history: dict[int, list[int]] = {}
        self._next_block = 0
        self.blocks: dict[int, list[int]] = {}

    def _blocks_for(self, slot: int, end: int) -> list[int]:
        need = -(-end // self.cc.block_tokens)
        if need > self.cc.max_blocks_per_seq:
            raise ValueError(f"sequence in slot {slot} needs {end} positions > max_model_len={self.cc.max_model_len}")
        blocks = self.blocks.setdefault(slot, [])
        while len(blocks) < need:
            if self._next_block >= self.cc.num_blocks:
                raise ValueError(f"out of cache blocks (num_blocks={self.cc.num_blocks})")
            blocks.append(self._next_block)
            self._next_block += 1
        return blocks

    def step(self, chunks: Sequence[tuple[int, Sequence[int]]], logits: str = "last", with_taps: bool = False,
             num_tokens: int | None = None, num_rows: int | None = None):
        """Run one ragged step over ``(slot, new token ids)`` chunks (each continues its slot's
        history). Returns ``(logits [L, V], main_hidden, taps)`` as numpy."""
        batch = self.batch_for(chunks, logits, num_tokens, num_rows)
        self.cache, lg, mh, taps = _step(self.graphdef, self.state, self.cache, batch, with_taps,
                                         self.batch_invariant)
        taps = jax.tree.map(np.asarray, taps) if taps is not None else None
        return np.asarray(lg), (None if mh is None else np.asarray(mh)), taps

    def batch_for(self, chunks: Sequence[tuple[int, Sequence[int]]], logits: str = "last",
                  num_tokens: int | None = None, num_rows: int | None = None):
        """The device ``ForwardBatch`` of ``step``'s chunks; appends them to the slots' histories
        and allocates their blocks (the caller runs the forward)."""
        rows = []
        for slot, toks in chunks:
            hist = self.history.setdefault(slot, [])
            start = len(hist)
            hist.extend(int(t) for t in toks)
            eids = None
            if self.hasher is not None:
                eids = self.hasher.hash_positions(np.asarray(hist), np.arange(start, len(hist)))
            rows.append(RowSpec(list(toks), start, slot, self._blocks_for(slot, len(hist)), eids))
        n_tok = num_tokens or sum(len(t) for _, t in chunks)
        hl = self.hasher
        batch = build_batch(rows, num_tokens=n_tok, num_rows=num_rows or len(rows),
                            max_blocks=self.cc.max_blocks_per_seq, num_slots=self.cc.num_slots,
                            n_engram_layers=hl.n_layers if hl else 0, n_hash_cols=hl.n_hash_cols if hl else 0,
                            logits=logits)
        return jax.tree.map(jnp.asarray, batch)

    def decode_step(self, slots: Sequence[int], token_ids: Sequence[int], num_rows: int | None = None) -> np.ndarray:
        """One new token per slot (``step`` with one-token chunks and ``logits="last"``), its input
        built without per-row array work: the Engram n-grams of all rows hashed in one call
        (``EngramHasher.hash_windows``). Every call with the same ``num_rows`` has one padded shape.
        Returns the logits ``[num_rows, V]`` as numpy (rows beyond the slots are padding)."""
        slots = [int(s) for s in slots]
        toks = np.asarray(token_ids, np.int64).reshape(-1)
        n = len(slots)
        if toks.shape[0] != n:
            raise ValueError(f"decode_step: {toks.shape[0]} tokens for {n} slots")
        starts = np.empty(n, np.int64)
        blocks = []
        hl = self.hasher
        K = hl.max_ngram_size if hl is not None else 0
        window = np.full((n, K), -1, np.int64)
        for i, (s, t) in enumerate(zip(slots, toks.tolist())):
            hist = self.history.setdefault(s, [])
            starts[i] = len(hist)
            hist.append(t)
            blocks.append(self._blocks_for(s, len(hist)))
            if K:
                tail = hist[-K:][::-1]  # the token at p, p-1, ... (-1 before position 0)
                window[i, :len(tail)] = tail
        eids = hl.hash_windows(window) if hl is not None else None
        zeros = np.zeros(n, np.int64)
        R = num_rows or n
        batch = pack_batch(toks, np.ones(n, np.int64), starts, np.asarray(slots, np.int64), blocks, zeros, zeros,
                           zeros, engram_ids=eids, num_tokens=R, num_rows=R, num_logits=R,
                           max_blocks=self.cc.max_blocks_per_seq, num_slots=self.cc.num_slots,
                           n_engram_layers=hl.n_layers if hl else 0, n_hash_cols=hl.n_hash_cols if hl else 0)
        self.cache, lg, _, _ = _step(self.graphdef, self.state, self.cache, jax.tree.map(jnp.asarray, batch),
                                     False, self.batch_invariant)
        return np.asarray(lg)

    def draft(self, slots: Sequence[int], input_ids: Sequence[int], with_taps: bool = False):
        """DSpark block for each slot after its last computed position; ``input_ids`` = the token
        the target chose for the next position."""
        last = np.asarray([len(self.history[s]) - 1 for s in slots], np.int32)
        ids, lg, conf, taps = _draft(self.graphdef, self.state, self.cache, jnp.asarray(input_ids, jnp.int32),
                                     jnp.asarray(last), jnp.asarray(slots, jnp.int32), with_taps,
                                     self.batch_invariant)
        taps = jax.tree.map(np.asarray, taps) if taps is not None else None
        return np.asarray(ids), np.asarray(lg), np.asarray(conf), taps

    def generate_greedy(self, prompt: Sequence[int], max_new_tokens: int, slot: int = 0,
                        chunk: int | None = None, num_tokens: int | None = None,
                        num_rows: int | None = None) -> list[int]:
        """Greedy continuation of one prompt (prefill in ``chunk``-sized pieces if given; every
        step padded to ``num_tokens`` tokens / ``num_rows`` rows if given, one compiled shape)."""
        chunk = chunk or len(prompt)
        pad = dict(num_tokens=num_tokens, num_rows=num_rows)
        for i in range(0, len(prompt), chunk):
            lg, _, _ = self.step([(slot, prompt[i:i + chunk])], **pad)
        out = [int(np.argmax(lg[0]))]
        for _ in range(max_new_tokens - 1):
            lg, _, _ = self.step([(slot, [out[-1]])], **pad)
            out.append(int(np.argmax(lg[0])))
        return out
