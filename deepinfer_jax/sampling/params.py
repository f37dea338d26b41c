"""Per-request sampling parameters, compatible with vLLM's ``SamplingParams``.

The fields, their defaults and their meaning follow ``vllm.SamplingParams`` (the subset this engine
supports). Construction only normalises (``top_k=-1`` becomes ``0``; ``stop`` given as one string
becomes a list; ``None`` lists become empty) and rejects unknown keywords; ``validate()`` checks the
values and raises ``ValueError`` naming the request index, the field and the bad value, e.g.
``"request 3: SamplingParams.top_p=1.5: must be in (0, 1]"``.

Structured output (``grammar_spec.py``): ``structured_output=(kind, spec)`` or vLLM's
``structured_outputs=StructuredOutputsParams(...)``; ``validate()`` normalises either into
``structured_output`` (a ``StructuredOutput``; ``structured_outputs`` then becomes ``None``).

``sampling_params_from_dict`` builds and validates one request's parameters from a JSON-like dict
(as a server receives them).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
from typing import Any, Mapping, Sequence

from deepinfer_jax.sampling.grammar_spec import StructuredOutputsParams, normalise

# As vLLM's ``_SAMPLING_EPS``: a temperature below this samples greedily.
SAMPLING_EPS = 1e-5
# Seeds are 64-bit words split into two uint32 on device; keep them in the signed int64 range.
MAX_SEED = 2**63


def _prefix(index: int | None) -> str:
    return "" if index is None else f"request {index}: "


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


@dataclasses.dataclass(init=False)
class SamplingParams:
    """Sampling parameters of one request (see the module docstring).

    Construct with keywords only; ``seq_seed`` is accepted as an alias of ``seed``. Defaults:
    ``n=1, temperature=1.0, top_p=1.0, top_k=0 (off; -1 also means off), min_p=0.0,
    max_tokens=16, min_tokens=0, stop=[], stop_token_ids=[], ignore_eos=False, logprobs=None,
    prompt_logprobs=None, seed=None, include_stop_str_in_output=False, skip_special_tokens=True,
    structured_output=None, structured_outputs=None``.
    """

    n: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    max_tokens: int
    min_tokens: int
    logprobs: int | None
    prompt_logprobs: int | None
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    structured_output: Any
    structured_outputs: Any

    def __init__(
        self,
        *,
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        ignore_eos: bool = False,
        max_tokens: int = 16,
        min_tokens: int = 0,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        structured_output: Any = None,
        structured_outputs: Any = None,
        seq_seed: int | None = None,
        **unknown: Any,
    ) -> None:
        if unknown:
            name, value = next(iter(unknown.items()))
            raise ValueError(unknown_field_message(name, value))
        if seq_seed is not None:
            if seed is not None and seed != seq_seed:
                raise ValueError(f"SamplingParams.seq_seed={seq_seed!r}: conflicts with seed={seed!r} "
                                 "(seq_seed is an alias of seed)")
            seed = seq_seed
        self.n = n
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = 0 if (_is_int(top_k) and top_k == -1) else top_k
        self.min_p = min_p
        self.seed = seed
        self.stop = _as_list(stop, str)
        self.stop_token_ids = _as_list(stop_token_ids, None)
        self.ignore_eos = ignore_eos
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self.logprobs = logprobs
        self.prompt_logprobs = prompt_logprobs
        self.include_stop_str_in_output = include_stop_str_in_output
        self.skip_special_tokens = skip_special_tokens
        self.structured_output = structured_output
        self.structured_outputs = structured_outputs

    @property
    def is_greedy(self) -> bool:
        """Argmax decoding: temperature below ``SAMPLING_EPS`` (i.e. 0, as vLLM) or ``top_k == 1``."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    def validate(self, index: int | None = None, max_logprobs: int = 20,
                 vocab_size: int | None = None) -> "SamplingParams":
        """Check every field; raise ``ValueError`` naming ``index`` (if given), the field and the
        value. ``max_logprobs`` bounds ``logprobs`` / ``prompt_logprobs``; ``vocab_size`` (if given)
        bounds ``stop_token_ids``. Returns ``self``."""

        def bad(field: str, value: Any, why: str) -> None:
            raise ValueError(f"{_prefix(index)}SamplingParams.{field}={value!r}: {why}")

        def check_int(field: str, lo: int, hi: int | None = None, optional: bool = False) -> None:
            value = getattr(self, field)
            if optional and value is None:
                return
            if not _is_int(value):
                bad(field, value, "must be an integer" + (" or None" if optional else ""))
            if value < lo or (hi is not None and value > hi):
                bad(field, value, f"must be in [{lo}, {hi}]" if hi is not None else f"must be >= {lo}")

        def check_bool(field: str) -> None:
            if not isinstance(getattr(self, field), bool):
                bad(field, getattr(self, field), "must be a bool")

        check_int("n", 1)
        if not _is_real(self.temperature) or self.temperature < 0:
            bad("temperature", self.temperature, "must be a finite number >= 0 (0 = greedy)")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", self.top_p, "must be in (0, 1]")
        if not _is_int(self.top_k) or not (self.top_k in (0, -1) or self.top_k >= 1):
            bad("top_k", self.top_k, "must be 0 or -1 (off) or an integer >= 1")
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", self.min_p, "must be in [0, 1]")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < MAX_SEED):
            bad("seed", self.seed, "must be None or an integer in [0, 2**63)")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", self.stop, "must be a string or a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list) or not all(_is_int(t) for t in self.stop_token_ids):
            bad("stop_token_ids", self.stop_token_ids, "must be a list of integers")
        for t in self.stop_token_ids:
            if t < 0 or (vocab_size is not None and t >= vocab_size):
                hi = "vocab_size" if vocab_size is None else f"vocab_size={vocab_size}"
                bad("stop_token_ids", self.stop_token_ids, f"token id {t} out of range [0, {hi})")
        check_bool("ignore_eos")
        check_int("max_tokens", 1)
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", self.min_tokens, f"must be in [0, max_tokens={self.max_tokens}]")
        check_int("logprobs", 0, max_logprobs, optional=True)
        check_int("prompt_logprobs", 0, max_logprobs, optional=True)
        check_bool("include_stop_str_in_output")
        check_bool("skip_special_tokens")
        self.structured_output = normalise(self.structured_output, self.structured_outputs,
                                           f"{_prefix(index)}SamplingParams")
        self.structured_outputs = None
        return self

    @property
    def grammar(self):
        """The normalised ``StructuredOutput`` (after ``validate()``), or None."""
        so = self.structured_output
        return so if so is not None and not isinstance(so, (tuple, list)) else None


FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(SamplingParams))
# Keys the constructor accepts: the fields plus the ``seq_seed`` alias.
ACCEPTED_KEYS: tuple[str, ...] = FIELD_NAMES + ("seq_seed",)


def unknown_field_message(name: Any, value: Any, index: int | None = None) -> str:
    """The error text for an unsupported keyword (with a close-match suggestion)."""
    hint = difflib.get_close_matches(str(name), ACCEPTED_KEYS, n=1)
    suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
    return f"{_prefix(index)}SamplingParams.{name}={value!r}: unknown field{suggestion}"


def _as_list(value: Any, scalar_type: type | None) -> Any:
    """``None`` -> ``[]``; a single ``scalar_type`` -> ``[value]``; list/tuple -> list copy. Anything
    else is returned unchanged so that ``validate()`` reports it."""
    if value is None:
        return []
    if scalar_type is not None and isinstance(value, scalar_type):
        return [value]
    if isinstance(value, (list, tuple)):
        return list(value)
    return value


def sampling_params_from_dict(d: Mapping[str, Any], index: int | None = None, *, max_logprobs: int = 20,
                              vocab_size: int | None = None) -> SamplingParams:
    """Build and validate one request's ``SamplingParams`` from a JSON-like mapping.

    Unknown keys raise ``ValueError`` naming ``index`` and the key. A ``None`` value stands for
    "not given" (JSON ``null`` as OpenAI-style clients send it), so the field keeps its default.
    Every other error comes from ``SamplingParams.validate(index, max_logprobs, vocab_size)``.
    """
    if not isinstance(d, Mapping):
        raise ValueError(f"{_prefix(index)}SamplingParams: expected a mapping of fields, got {type(d).__name__}")
    for key, value in d.items():
        if key not in ACCEPTED_KEYS:
            raise ValueError(unknown_field_message(key, value, index))
    kwargs = {k: v for k, v in d.items() if v is not None}
    if isinstance(kwargs.get("structured_outputs"), Mapping):  # vLLM's JSON form
        kwargs["structured_outputs"] = {k: v for k, v in kwargs["structured_outputs"].items() if v is not None}
    try:
        params = SamplingParams(**kwargs)
    except ValueError as e:  # seed / seq_seed conflict
        raise ValueError(f"{_prefix(index)}{e}") from None
    return params.validate(index, max_logprobs=max_logprobs, vocab_size=vocab_size)
