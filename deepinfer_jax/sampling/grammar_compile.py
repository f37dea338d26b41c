"""Compiling structured-output requests with xgrammar: the tokenizer's vocabulary as xgrammar
sees it, a cache of compiled grammars and a thread pool that compiles a batch of requests at once.

xgrammar is the optional ``[grammar]`` extra: it is imported here on first use only, so the
package imports without it; asking for structured output without it raises ``ValueError``
naming the extra (``require_xgrammar``).

The vocabulary: ``tokenizer.json``'s BPE / WordPiece vocab by id, special tokens as empty
strings (xgrammar then never allows them, except the EOS ids, which it allows exactly where the
grammar may end), ids past the tokenizer up to the model's ``vocab_size`` empty as well.

``GrammarCompiler.compile_all(items)`` compiles ``(label, StructuredOutput)`` pairs in the pool
(equal requests share one compiled grammar, cached by ``(kind, text)``, least recently used
dropped past ``cache_size``) and raises ``ValueError`` naming the first bad request and
xgrammar's reason; nothing is compiled on the step loop's path.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import os
import re
import threading
from typing import Any, Sequence

from deepinfer_jax.sampling.grammar_spec import StructuredOutput

INSTALL_HINT = ("structured output needs xgrammar, the [grammar] extra: "
                "pip install 'deepinfer_jax[grammar]' (see README, Install)")


def require_xgrammar():
    """The ``xgrammar`` module, or ``ValueError`` naming the extra when it is not installed."""
    try:
        import xgrammar
    except ImportError as e:
        raise ValueError(f"{INSTALL_HINT} (import failed: {e})") from None
    return xgrammar


def bitmask_words(vocab_size: int) -> int:
    """W: int32 words of one bitmask row (32 token ids per word)."""
    return -(-vocab_size // 32)


def vocab_from_tokenizer_json(path: str | os.PathLike, vocab_size: int) -> tuple[list[str], str]:
    """``(encoded_vocab, vocab_type)`` of a ``tokenizer.json`` for xgrammar's ``TokenizerInfo``:
    token strings by id (special tokens and unused ids ``""``) and ``"byte_level"`` for a
    ByteLevel decoder, ``"byte_fallback"`` for a ByteFallback one, else ``"raw"``."""
    tj = json.loads(open(path, encoding="utf-8").read())
    vocab = tj.get("model", {}).get("vocab", {})
    if isinstance(vocab, list):  # Unigram: [[piece, score], ...]
        vocab = {p[0]: i for i, p in enumerate(vocab)}
    enc = [""] * vocab_size
    for s, i in vocab.items():
        if 0 <= i < vocab_size:
            enc[i] = s
    for t in tj.get("added_tokens", []):
        if 0 <= t["id"] < vocab_size:
            enc[t["id"]] = "" if t.get("special") else t["content"]
    dec = json.dumps(tj.get("decoder"))
    vtype = "byte_level" if "ByteLevel" in dec else "byte_fallback" if "ByteFallback" in dec else "raw"
    return enc, vtype


def control_free_mask(encoded_vocab: Sequence[str], vocab_type: str) -> "np.ndarray":
    """int32 ``[W]`` bitmask of the tokens whose bytes hold no control byte (< 0x20).

    JSON text never holds a raw control byte in compact form (no whitespace; inside strings
    they must be escaped), but xgrammar 0.2.9's string rule with ``maxLength`` / ``minLength``
    admits them; the JSON kinds AND this mask into every row they fill."""
    import numpy as np

    def has_control(tok: str) -> bool:
        if vocab_type == "byte_level":  # GPT-2's byte-to-unicode table: bytes 0..32 are chr(256 + b)
            return any(256 <= ord(ch) < 256 + 0x20 for ch in tok)
        if vocab_type == "byte_fallback" and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", tok):
            return int(tok[3:5], 16) < 0x20
        return any(ord(ch) < 0x20 for ch in tok)

    ok = np.array([bool(t) and not has_control(t) for t in encoded_vocab], bool)
    bits = np.zeros(bitmask_words(len(ok)) * 32, bool)
    bits[:len(ok)] = ok
    words = np.packbits(bits.reshape(-1, 32)[:, ::-1], axis=1, bitorder="big").view(">u4")[:, 0]
    return words.astype(np.uint32).view(np.int32)


def _reason(e: Exception) -> str:
    """xgrammar's message without its C++ source location prefix."""
    msg = str(e).strip()
    return re.sub(r"^\[[0-9:]+\] [^ ]+:\d+: ", "", msg).splitlines()[0] if msg else type(e).__name__


class GrammarCompiler:
    """Compiles ``StructuredOutput`` requests for one tokenizer (see the module docstring)."""

    def __init__(self, tokenizer_json: str | os.PathLike, vocab_size: int, stop_token_ids: Sequence[int],
                 threads: int = 4, cache_size: int = 256):
        xgr = require_xgrammar()
        self.vocab_size = int(vocab_size)
        self.stop_token_ids = [int(t) for t in stop_token_ids]
        enc, vtype = vocab_from_tokenizer_json(tokenizer_json, self.vocab_size)
        vt = {"byte_level": xgr.VocabType.BYTE_LEVEL, "byte_fallback": xgr.VocabType.BYTE_FALLBACK,
              "raw": xgr.VocabType.RAW}[vtype]
        self.json_mask_W = control_free_mask(enc, vtype)
        # EOS stays allowed where the grammar allows it
        for t in self.stop_token_ids:
            self.json_mask_W[t // 32] |= (1 << (t % 32)) - (1 << 32 if t % 32 == 31 else 0)
        self.tokenizer_info = xgr.TokenizerInfo(enc, vt, vocab_size=self.vocab_size,
                                                stop_token_ids=self.stop_token_ids)
        self._xgr = xgr
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=threads, cache_enabled=False)
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="grammar-compile")
        self._cache: collections.OrderedDict[tuple[str, str], Any] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.cache_size = cache_size
        self.num_compiled = 0  # grammars compiled (cache misses)

    @property
    def words(self) -> int:
        return bitmask_words(self.vocab_size)

    def _compile(self, so: StructuredOutput):
        c = self._compiler
        if so.kind == "json_schema":
            # compact separators and no free whitespace: bounded schemas give bounded outputs
            return c.compile_json_schema(so.text, any_whitespace=False, separators=(",", ":"))
        if so.kind == "json_object":
            return c.compile_builtin_json_grammar()
        if so.kind == "regex":
            return c.compile_regex(so.text)
        if so.kind == "ebnf":
            return c.compile_grammar(so.text)
        raise ValueError(f"unknown structured output kind {so.kind!r}")

    def _cached(self, so: StructuredOutput):
        key = so.cache_key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        cg = self._compile(so)
        with self._lock:
            self._cache[key] = cg
            self.num_compiled += 1
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return cg

    def compile_all(self, items: Sequence[tuple[Any, StructuredOutput]]) -> list:
        """The compiled grammar of each ``(label, StructuredOutput)``, compiled in the pool;
        ``ValueError`` naming the first request (in order) that does not compile, and why."""
        futures = [self._pool.submit(self._cached, so) for _, so in items]
        out, first_error = [], None
        for (label, so), f in zip(items, futures):
            try:
                out.append(f.result())
            except Exception as e:  # xgrammar raises RuntimeError / its own errors with the reason
                if first_error is None:
                    first_error = ValueError(f"request {label}: SamplingParams.structured_output={so.short()}: "
                                             f"does not compile: {_reason(e)}")
                out.append(None)
        if first_error is not None:
            raise first_error
        return out

    def matcher(self, compiled):
        """A fresh xgrammar matcher of one compiled grammar (one per request sample); xgrammar
        0.2 matchers roll back any number of tokens (the draft rows need up to K)."""
        return self._xgr.GrammarMatcher(compiled)

    def extra_mask(self, so: StructuredOutput):
        """The int32 ``[W]`` mask ANDed into every row this kind fills (``None``: none)."""
        return self.json_mask_W if so.kind in ("json_schema", "json_object") else None

    def close(self) -> None:
        self._pool.shutdown(wait=False)
