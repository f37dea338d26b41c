"""One request's grammar state: an xgrammar matcher that advances on the request's emitted
tokens, and the bitmask rows of its next step, filled ahead of time.

``prepare(drafts)`` fills ``mask_KW`` (int32 ``[K+1, W]``, the xgrammar layout: bit ``v % 32`` of
word ``v // 32`` set = token ``v`` allowed): row 0 for the next sampled token, and with DSpark
drafts ``d_1..d_l`` row ``i`` for the token after ``d_1..d_i`` (fill, accept ``d_i``, fill, ...,
then roll the accepted drafts back). A draft the grammar refuses leaves every later row
all-zero: verification rejects that draft (its row does not allow it) and never reaches the
later rows. The engine calls ``prepare`` right after a step's results are applied, i.e. while
the next step runs on the device (async scheduling), so the fill is off the step's path.

``advance(tokens)`` accepts emitted tokens (the sampled token, or a verification row's accepted
drafts and correction / bonus); a token the matcher refuses is a bug of the masking and raises.
"""

from __future__ import annotations

import numpy as np


class GrammarState:
    def __init__(self, matcher, words: int, max_drafts: int = 0, and_mask_W=None):
        """``and_mask_W``: an int32 ``[W]`` mask ANDed into every filled row (the JSON kinds'
        control-byte mask, ``GrammarCompiler.extra_mask``), or None."""
        self.matcher = matcher
        self.and_mask_W = and_mask_W
        self.words = words
        self.max_drafts = max_drafts
        self.mask_KW = np.zeros((max_drafts + 1, words), np.int32)
        self.num_rows_ready = 0   # rows of mask_KW valid for the matcher's current state
        self.drafts: tuple[int, ...] = ()   # the drafts mask_KW was filled for
        self.fill_seconds = 0.0

    @property
    def terminated(self) -> bool:
        """The grammar accepted EOS (or can take no further token)."""
        return self.matcher.is_terminated()

    def advance(self, tokens) -> None:
        for t in tokens:
            if self.matcher.is_terminated():
                return  # tokens after EOS are not the grammar's (the engine stops the request)
            if not self.matcher.accept_token(int(t)):
                raise RuntimeError(f"the grammar refused emitted token {int(t)} (masking bug)")
        self.num_rows_ready = 0

    def prepare(self, drafts=()) -> None:
        """Fill the mask rows of the next step for ``drafts`` (at most ``max_drafts``)."""
        import time

        t0 = time.perf_counter()
        drafts = tuple(int(d) for d in drafts[:self.max_drafts])
        m = self.matcher
        self.mask_KW[:] = 0
        m.fill_next_token_bitmask(self.mask_KW, 0)
        accepted = 0
        for i, d in enumerate(drafts):
            if m.is_terminated() or not m.accept_token(d):
                break  # later rows stay all-zero: the draft is rejected at row i
            accepted += 1
            if m.is_terminated():
                break  # d_i was EOS: nothing may follow it (the request ends there)
            m.fill_next_token_bitmask(self.mask_KW, i + 1)
        if accepted:
            m.rollback(accepted)
        if self.and_mask_W is not None:
            self.mask_KW &= self.and_mask_W
        self.drafts = drafts
        self.num_rows_ready = len(drafts) + 1
        self.fill_seconds += time.perf_counter() - t0

    def rows(self, num_drafts: int, drafts=()) -> np.ndarray:
        """The ``[num_drafts + 1, W]`` mask rows for a row verifying ``drafts`` (filled now if the
        prepared rows were for other drafts)."""
        drafts = tuple(int(d) for d in drafts[:num_drafts])
        if self.num_rows_ready < num_drafts + 1 or self.drafts[:num_drafts] != drafts:
            self.prepare(drafts)
        return self.mask_KW[:num_drafts + 1]
