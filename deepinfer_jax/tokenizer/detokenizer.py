"""Incremental (streaming) detokenization.

``IncrementalDetokenizer`` turns output token ids, pushed as they are sampled, into text deltas
whose concatenation equals ``decode(prompt + output)`` minus ``decode(prompt)`` (whenever that
difference is a clean suffix, see below). It uses the prefix_offset / read_offset scheme of vLLM
and TGI rather than decoding tokens one by one, because a token's text depends on its
neighbours (SentencePiece/Metaspace leading spaces, WordPiece ``##`` joins, byte-level BPE
characters spread over several tokens):

* ``ids[prefix_offset:read_offset]`` is a short window of tokens already turned into text;
  ``ids[read_offset:]`` are tokens not yet emitted.
* For each new token, ``decode(ids[prefix_offset:])`` is compared with the window's text
  ``decode(ids[prefix_offset:read_offset])``; the new suffix is emitted and the window slides
  forward (``prefix_offset = read_offset``, ``read_offset = len(ids)``).
* Nothing is emitted while the decoded text ends with U+FFFD (an incomplete UTF-8 sequence:
  byte-level BPE splits multi-byte characters over tokens), so characters come out whole.
  ``finish()`` flushes anything still held (e.g. a sequence that never completes).

The first window is the tail of the prompt (the last ``context_tokens`` tokens that decode to
something), so the first output token's leading space / join behaves as in a full decode.

Caveat: when ``decode(prompt)`` itself ends with an incomplete UTF-8 sequence that the output
completes, ``decode(prompt + output)`` does not extend ``decode(prompt)``; the detokenizer then
emits only the text after that character (as vLLM does).

Byte-level tokenizers (``byte_level.py``) take a shortcut with the same output: the emitted
window's text ends with a whole character, so the text of ``window + new`` is the window's text
followed by the UTF-8 decode of the new tokens' bytes alone. The detokenizer then keeps only the
new tokens' bytes and decodes those (no tokenizer call per token). It takes the general path
when the prompt's tail text ends with U+FFFD, where that split does not hold.

This module must not import JAX.
"""

from __future__ import annotations

from typing import Iterable

from .loader import TokenizerInfo

__all__ = ["IncrementalDetokenizer"]

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Streaming detokenizer of one request's output.

    Args:
        tok: the loaded tokenizer.
        prompt_ids: the prompt token ids (only the tail is kept, as context).
        skip_special_tokens: drop ``tok.all_special_ids`` from the text.
        context_tokens: how many visible prompt tokens seed the first window.

    Attributes:
        text: all output text emitted so far (held-back bytes excluded until complete/finish).
        token_ids: all output token ids pushed so far.
    """

    def __init__(self, tok: TokenizerInfo, prompt_ids: Iterable[int], skip_special_tokens: bool = True,
                 context_tokens: int = 5) -> None:
        self._tok = tok
        self._skip = bool(skip_special_tokens)
        prompt = [int(i) for i in prompt_ids]
        start = self._context_start(prompt, context_tokens)
        # _ids holds the context window + unfinished output tokens; offsets index into it.
        self._ids: list[int] = prompt[start:]
        self.prefix_offset = 0
        self.read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self.text = ""
        self.token_ids: list[int] = []
        # byte-level shortcut: the bytes of the tokens not emitted yet, and their count
        self._table = tok.byte_table(self._skip) if not self._prefix_text.endswith(_REPLACEMENT) else None
        self._held = b""
        self._num_held = 0

    # ------------------------------------------------------------------ helpers

    def _visible(self, token_id: int) -> bool:
        """Whether ``token_id`` contributes text (not skipped as special, inside the vocab)."""
        if self._skip and token_id in self._tok.all_special_ids:
            return False
        return self._tok.id_to_token(token_id) is not None

    def _context_start(self, prompt: list[int], n: int) -> int:
        """Index where the prompt tail holding ``n`` visible tokens starts (0 if fewer)."""
        seen = 0
        for i in range(len(prompt) - 1, -1, -1):
            if seen >= n:
                return i + 1
            if self._visible(prompt[i]):
                seen += 1
        return 0

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def _advance(self, final: bool) -> str:
        """Emit the text of ``ids[read_offset:]`` if it is complete (or ``final``)."""
        new_text = self._decode(self._ids[self.prefix_offset:])
        if len(new_text) <= len(self._prefix_text):
            return ""
        if not final and new_text.endswith(_REPLACEMENT):
            return ""  # incomplete UTF-8 sequence: wait for the next token
        delta = new_text[len(self._prefix_text):]
        # Slide the window: the just-emitted tokens become the context of the next decode.
        del self._ids[:self.read_offset]
        self.prefix_offset = 0
        self.read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self.text += delta
        return delta

    # ------------------------------------------------------------------ API

    def push(self, new_ids: Iterable[int]) -> str:
        """Add output tokens; return the text they finalise (may be ``""`` while bytes are held).

        Tokens are processed one at a time, so the result does not depend on how the ids are
        chunked across calls.
        """
        if self._table is not None:
            return self._push_bytes(new_ids)
        out: list[str] = []
        for token_id in new_ids:
            token_id = int(token_id)
            self.token_ids.append(token_id)
            self._ids.append(token_id)
            delta = self._advance(final=False)
            if delta:
                out.append(delta)
        return "".join(out)

    def _push_bytes(self, new_ids: Iterable[int]) -> str:
        """``push`` for byte-level tokenizers: the held tokens' bytes, decoded alone.

        Several ids at once whose bytes end with a whole character are decoded in one call: the
        same text as one token at a time, since after a whole character UTF-8 decoding starts
        afresh (the token-by-token loop emits exactly where the held bytes end with one)."""
        table, n = self._table, len(self._table)
        ids = [int(t) for t in new_ids]
        if len(ids) > 1:
            parts = [table[t] if 0 <= t < n else b"" for t in ids]
            held = self._held + b"".join(parts)
            delta = held.decode("utf-8", "replace")
            if delta and not delta.endswith(_REPLACEMENT):
                self.token_ids += ids
                trailing = 0  # tokens after the last one with bytes (specials): held, as one by one
                while trailing < len(parts) and not parts[-1 - trailing]:
                    trailing += 1
                self._held, self._num_held = b"", trailing
                self.text += delta
                return delta
        out: list[str] = []
        for token_id in ids:
            self.token_ids.append(token_id)
            self._held += table[token_id] if 0 <= token_id < n else b""
            self._num_held += 1
            if not self._held:
                continue
            delta = self._held.decode("utf-8", "replace")
            if delta.endswith(_REPLACEMENT):
                continue  # incomplete UTF-8 sequence: wait for the next token
            self._held, self._num_held = b"", 0
            self.text += delta
            out.append(delta)
        return "".join(out)

    def finish(self) -> str:
        """Flush text held back for an incomplete UTF-8 sequence; return it (``""`` if none)."""
        if self._table is not None:
            delta = self._held.decode("utf-8", "replace")
            self._held, self._num_held = b"", 0
            self.text += delta
            return delta
        return self._advance(final=True)

    @property
    def num_held_tokens(self) -> int:
        """Output tokens pushed whose text has not been emitted yet."""
        if self._table is not None:
            return self._num_held
        return len(self._ids) - self.read_offset
