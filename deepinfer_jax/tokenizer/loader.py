"""Load a Hugging Face fast tokenizer (``tokenizer.json``) without ``transformers``.

``load_tokenizer(model_dir)`` reads ``<model_dir>/tokenizer.json`` with
``tokenizers.Tokenizer.from_file`` and, when present, ``<model_dir>/tokenizer_config.json`` for
the special-token strings (``bos_token``, ``eos_token``, ...), ``add_bos_token`` and
``chat_template`` (a ``chat_template.jinja`` file next to it is used when the config has none).

The result is a :class:`TokenizerInfo`: the raw ``tokenizers.Tokenizer`` plus the ids and flags
the engine needs, and ``encode`` / ``decode`` helpers with the engine's conventions:

* ``encode`` never lets the ``tokenizer.json`` post-processor add special tokens; it prepends
  BOS itself when ``add_bos`` is set and the text does not already start with BOS (e.g. because a
  chat template wrote the BOS string).
* ``decode(..., skip_special_tokens=True)`` drops every id in ``all_special_ids`` (the tokens
  marked special in ``tokenizer.json`` plus the special tokens named in ``tokenizer_config.json``).
  Ids outside the tokenizer's vocabulary (a model's padded vocab rows) decode to nothing.

No ``clean_up_tokenization_spaces`` post-processing is applied (``transformers`` does that when
the config asks for it); the decoders in ``tokenizer.json`` are used as they are.

This module must not import JAX.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Iterable

from tokenizers import Tokenizer

__all__ = ["TokenizerInfo", "load_tokenizer"]

# tokenizer_config.json keys naming special tokens (the transformers SPECIAL_TOKENS_ATTRIBUTES).
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                 "mask_token")


@dataclasses.dataclass(eq=False)
class TokenizerInfo:
    """A loaded tokenizer and the ids/flags the engine needs.

    Attributes:
        tokenizer: the ``tokenizers.Tokenizer`` read from ``tokenizer.json``.
        bos_token_id / eos_token_id: from ``tokenizer_config.json`` token strings when they
            resolve, else the ids given by the caller (model config), else ``None``.
        add_bos: whether :meth:`encode` prepends BOS.
        vocab_size: tokenizer vocabulary size including added tokens (may be smaller than the
            model's padded ``vocab_size``).
        all_special_ids: ids dropped by ``decode(..., skip_special_tokens=True)``.
        chat_template: the Jinja chat template text, if the model ships one.
        bos_token / eos_token: the token strings, if known.
    """

    tokenizer: Tokenizer
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos: bool
    vocab_size: int
    all_special_ids: set[int]
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    _byte_tables: Any = dataclasses.field(default=None, repr=False)

    def byte_table(self, skip_special_tokens: bool) -> list[bytes] | None:
        """Each id's bytes when the tokenizer is byte-level (``byte_level.py``; built and checked
        on first use), with special ids empty under ``skip_special_tokens``; else ``None``."""
        if self._byte_tables is None:
            from .byte_level import token_byte_tables

            self._byte_tables = token_byte_tables(self) or ()
        if not self._byte_tables:
            return None
        return self._byte_tables[1 if skip_special_tokens else 0]

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; BOS prepended when ``add_bos`` and not already first.

        Special-token strings inside ``text`` (e.g. written by a chat template) are matched as
        their added tokens; no other special tokens are added.
        """
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; with ``skip_special_tokens`` every id in ``all_special_ids`` is dropped."""
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            special = self.all_special_ids
            ids = [i for i in ids if i not in special]
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The token string of ``token_id`` (``None`` outside the vocabulary)."""
        return self.tokenizer.id_to_token(int(token_id))


def _token_content(value: Any) -> str | None:
    """A special token entry of tokenizer_config.json: a string, or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_chat_template(model_dir: str, cfg: dict[str, Any]) -> str | None:
    tmpl = cfg.get("chat_template")
    if isinstance(tmpl, list):  # [{"name": ..., "template": ...}, ...]: use "default" or the first
        named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
        tmpl = named.get("default", next(iter(named.values()), None))
    if isinstance(tmpl, str):
        return tmpl
    path = os.path.join(model_dir, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    return None


def _post_processor_adds_bos(tok: Tokenizer, bos_id: int) -> bool:
    """Whether ``tokenizer.json``'s post-processor prepends ``bos_id`` (used when the config is silent)."""
    try:
        with_special = tok.encode("a", add_special_tokens=True).ids
        without = tok.encode("a", add_special_tokens=False).ids
    except Exception:  # noqa: BLE001 - an odd post-processor: assume no BOS
        return False
    return bool(with_special) and with_special[0] == bos_id and (not without or without[0] != bos_id)


def load_tokenizer(model_dir: str | os.PathLike, bos_token_id: int | None = None,
                   eos_token_id: int | None = None, add_bos: bool | None = None) -> TokenizerInfo:
    """Load ``<model_dir>/tokenizer.json`` (+ ``tokenizer_config.json`` if present).

    Args:
        model_dir: the model directory.
        bos_token_id / eos_token_id: fallbacks (e.g. from the model config) used when
            ``tokenizer_config.json`` does not name a token that resolves to an id.
        add_bos: override for BOS handling. ``None``: ``add_bos_token`` from the config, else
            whether the ``tokenizer.json`` post-processor adds BOS.

    Raises:
        ValueError: ``tokenizer.json`` is missing, or a file cannot be parsed; the message names
            the directory or file.
    """
    model_dir = os.fspath(model_dir)
    tok_path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(tok_path):
        raise ValueError(f"no tokenizer.json in model directory {model_dir!r}")
    try:
        tok = Tokenizer.from_file(tok_path)
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise ValueError(f"cannot read {tok_path!r}: {e}") from e

    cfg: dict[str, Any] = {}
    cfg_path = os.path.join(model_dir, "tokenizer_config.json")
    if os.path.isfile(cfg_path):
        try:
            with open(cfg_path, encoding="utf-8") as f:
                cfg = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read {cfg_path!r}: {e}") from e
        if not isinstance(cfg, dict):
            raise ValueError(f"{cfg_path!r} does not hold a JSON object")

    def resolve(key: str, fallback: int | None) -> tuple[int | None, str | None]:
        content = _token_content(cfg.get(key))
        tid = tok.token_to_id(content) if content is not None else None
        if tid is None:
            tid = None if fallback is None else int(fallback)
            if content is None and tid is not None:
                content = tok.id_to_token(tid)
        return tid, content

    bos_id, bos_tok = resolve("bos_token", bos_token_id)
    eos_id, eos_tok = resolve("eos_token", eos_token_id)

    special: set[int] = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    names = [_token_content(cfg.get(k)) for k in _SPECIAL_KEYS]
    names += [_token_content(t) for t in cfg.get("additional_special_tokens") or []]
    for name in names:
        tid = tok.token_to_id(name) if name is not None else None
        if tid is not None:
            special.add(tid)
    special.update(i for i in (bos_id, eos_id) if i is not None)

    if add_bos is None:
        if "add_bos_token" in cfg:
            add_bos = bool(cfg["add_bos_token"])
        else:
            add_bos = bos_id is not None and _post_processor_adds_bos(tok, bos_id)
    add_bos = bool(add_bos) and bos_id is not None

    return TokenizerInfo(
        tokenizer=tok,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        add_bos=add_bos,
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        all_special_ids=special,
        chat_template=_read_chat_template(model_dir, cfg),
        bos_token=bos_tok,
        eos_token=eos_tok,
    )
