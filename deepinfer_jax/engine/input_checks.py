"""Checks of request input, shared by every entry point (``LLM.generate``, ``LLMEngine.add_request``).

* ``as_prompt_list(prompts)``: the ``prompts`` argument of ``generate`` as a list of prompts. One
  prompt is a str, a dict, a sequence of token ids or a 1-D integer array; a list of those (or a
  2-D integer array, one prompt per row) is a batch.
* ``parse_prompt(label, prompt, tokenizer)``: one prompt -> ``(token ids, text or None)``. Ids
  must be integers (numpy integers too; bools are not); a dict giving both ``prompt`` and
  ``prompt_token_ids`` must agree (the text tokenizes to the ids).
* ``check_prompt_ids`` / ``check_params``: ids inside the vocabulary and leaving room for one
  output token under ``max_model_len``; the sampling parameters validated.

Errors are ``ValueError`` naming the request (its index in a batch, or its id) and the field.
"""

from __future__ import annotations

import numbers
from typing import Any, Mapping, Sequence

import numpy as np

from deepinfer_jax.sampling.params import SamplingParams

PROMPT_KEYS = ("prompt", "prompt_token_ids")


def _looks_like_id(x: Any) -> bool:
    return isinstance(x, (numbers.Integral, np.bool_))


def is_token_id(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def as_prompt_list(prompts: Any) -> list:
    """The prompts of one ``generate`` call, one entry per request."""
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if isinstance(prompts, np.ndarray):
        if prompts.ndim == 1:
            return [prompts]
        if prompts.ndim == 2:
            return list(prompts)
        raise ValueError(f"prompts: a {prompts.ndim}-D array; expected 1-D (one prompt of token ids) "
                         "or 2-D (one prompt per row)")
    if prompts is None or isinstance(prompts, (numbers.Number, np.generic, bytes, bytearray)) or \
            not hasattr(prompts, "__iter__"):
        raise ValueError(f"prompts={prompts!r}: expected a prompt (str, token ids, or a dict with 'prompt' / "
                         "'prompt_token_ids') or a list of prompts")
    out = list(prompts)
    if out and _looks_like_id(out[0]):
        return [out]  # one prompt of token ids
    return out


def _token_ids(label, value: Any) -> list[int]:
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or value.dtype.kind not in "iu":
            raise ValueError(f"request {label}: prompt_token_ids array of shape {value.shape} and dtype "
                             f"{value.dtype}; expected a 1-D integer array")
        return [int(t) for t in value.tolist()]
    if isinstance(value, (str, bytes, bytearray)) or not isinstance(value, Sequence):
        raise ValueError(f"request {label}: prompt_token_ids of type {type(value).__name__}; expected a "
                         "sequence of integer token ids")
    for j, t in enumerate(value):
        if not is_token_id(t):
            raise ValueError(f"request {label}: prompt_token_ids[{j}]={t!r}: token ids must be integers")
    return [int(t) for t in value]


def _tokenize(label, text: str, tokenizer) -> list[int]:
    if tokenizer is None:
        raise ValueError(f"request {label}: text prompt but the model has no tokenizer.json; "
                         "pass prompt_token_ids")
    if not text:
        return []
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"request {label}: prompt is not valid Unicode text ({e.reason} at "
                         f"character {e.start})") from None
    try:
        return list(tokenizer.encode(text))
    except Exception as e:  # the tokenizers library raises TypeError / its own exceptions
        raise ValueError(f"request {label}: prompt could not be tokenized: {e}") from None


def parse_prompt(label, prompt: Any, tokenizer) -> tuple[list[int], str | None]:
    """Token ids and text (None for an ids-only prompt) of one prompt."""
    if isinstance(prompt, Mapping):
        unknown = set(prompt) - set(PROMPT_KEYS)
        if unknown:
            raise ValueError(f"request {label}: unknown prompt field(s) {sorted(map(str, unknown))}; "
                             "expected 'prompt' or 'prompt_token_ids'")
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise ValueError(f"request {label}: prompt dict field 'prompt' of type {type(text).__name__}; "
                             "expected str")
        if "prompt_token_ids" in prompt:
            ids = _token_ids(label, prompt["prompt_token_ids"])
            if text is not None and tokenizer is not None and _tokenize(label, text, tokenizer) != ids:
                raise ValueError(f"request {label}: 'prompt' and 'prompt_token_ids' disagree (the text "
                                 "tokenizes to other ids); give one of them")
            return ids, text
        if text is None:
            raise ValueError(f"request {label}: prompt dict needs 'prompt' or 'prompt_token_ids'")
        return _tokenize(label, text, tokenizer), text
    if isinstance(prompt, str):
        return _tokenize(label, prompt, tokenizer), prompt
    if isinstance(prompt, np.ndarray) or (isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray))):
        return _token_ids(label, prompt), None
    raise ValueError(f"request {label}: prompt of type {type(prompt).__name__}; expected str, a sequence of "
                     "token ids or a dict with 'prompt' / 'prompt_token_ids'")


def check_prompt_ids(label, ids: list[int], *, vocab_size: int | None, max_model_len: int) -> None:
    if not ids:
        raise ValueError(f"request {label}: prompt is empty")
    bad = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if bad:
        hi = vocab_size if vocab_size is not None else "vocab_size"
        raise ValueError(f"request {label}: prompt_token_ids {bad[:5]} outside the vocabulary [0, {hi})")
    if len(ids) >= max_model_len:
        raise ValueError(f"request {label}: prompt has {len(ids)} tokens; max_model_len={max_model_len} leaves "
                         "no room for an output token")


def check_params(label, params: Any, *, max_logprobs: int, vocab_size: int | None) -> SamplingParams:
    if not isinstance(params, SamplingParams):
        raise ValueError(f"request {label}: sampling params of type {type(params).__name__}; "
                         "expected SamplingParams")
    return params.validate(label, max_logprobs=max_logprobs, vocab_size=vocab_size)


def params_list(sampling_params: Any, num_prompts: int) -> list:
    """One ``SamplingParams`` (or whatever was given, checked later) per prompt."""
    if sampling_params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    if isinstance(sampling_params, (str, bytes, Mapping)) or not hasattr(sampling_params, "__iter__"):
        raise ValueError(f"sampling_params of type {type(sampling_params).__name__}; expected SamplingParams "
                         "or a list of them")
    params = list(sampling_params)
    if len(params) != num_prompts:
        raise ValueError(f"{len(params)} sampling params for {num_prompts} prompts")
    return params
