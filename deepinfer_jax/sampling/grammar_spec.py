"""Structured output requests: the accepted forms, normalised to one ``(kind, text)`` pair.

Two forms are accepted on ``SamplingParams``:

* DeepInfer's: ``structured_output=(kind, spec)`` with ``kind`` one of ``KINDS``:
  ``"json_schema"`` (a dict, a pydantic model class or a JSON string), ``"regex"`` (a string),
  ``"ebnf"`` (a GBNF / EBNF grammar string whose start rule is ``root``) or ``"json_object"``
  (any JSON object; ``spec`` is ignored and may be ``None``).
* vLLM's: ``structured_outputs=StructuredOutputsParams(json=..., regex=..., grammar=...,
  choice=[...], json_object=True)`` (a dict of those keys works too). Exactly one field may be set;
  ``choice`` becomes a regex matching one of the strings literally.

``normalise(value, label)`` turns either form into a ``StructuredOutput(kind, text)`` whose
``text`` is canonical (a schema as sorted compact JSON), so that equal requests share one
compiled grammar. Nothing here imports xgrammar or JAX; compiling is ``grammar_compile.py``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Mapping, Sequence

KINDS = ("json_schema", "regex", "ebnf", "json_object")
VLLM_FIELDS = ("json", "regex", "grammar", "choice", "json_object")


@dataclasses.dataclass(frozen=True)
class StructuredOutput:
    """A normalised structured-output request: ``kind`` in ``KINDS``, ``text`` its canonical
    source (JSON schema text, regex, EBNF grammar; ``""`` for ``json_object``)."""

    kind: str
    text: str

    @property
    def cache_key(self) -> tuple[str, str]:
        return (self.kind, self.text)

    def short(self, limit: int = 80) -> str:
        t = self.text if len(self.text) <= limit else self.text[:limit - 3] + "..."
        return f"({self.kind!r}, {t!r})"


@dataclasses.dataclass
class StructuredOutputsParams:
    """vLLM's structured-output parameters (the fields this engine supports). Set exactly one of
    ``json`` (a JSON schema: dict, pydantic model class or JSON string), ``regex``, ``grammar``
    (EBNF), ``choice`` (a list of strings) or ``json_object=True``."""

    json: Any = None
    regex: str | None = None
    grammar: str | None = None
    choice: Sequence[str] | None = None
    json_object: bool | None = None


def _schema_text(spec: Any, where: str) -> str:
    """A JSON schema given as a dict, a pydantic model class or a JSON string, as canonical text."""
    if isinstance(spec, type) and hasattr(spec, "model_json_schema"):  # a pydantic v2 model class
        spec = spec.model_json_schema()
    if isinstance(spec, (str, bytes)):
        try:
            spec = json.loads(spec)
        except ValueError as e:
            raise ValueError(f"{where}: the JSON schema string is not valid JSON ({e})") from None
    if isinstance(spec, bool):  # JSON Schema allows true (anything) / false (nothing)
        raise ValueError(f"{where}: a boolean schema is not supported; give an object schema")
    if not isinstance(spec, Mapping):
        raise ValueError(f"{where}: the JSON schema must be a dict, a pydantic model class or a JSON "
                         f"string, got {type(spec).__name__}")
    try:
        return json.dumps(spec, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: the JSON schema is not JSON-serialisable ({e})") from None


def choice_regex(choices: Sequence[str]) -> str:
    """A regex matching exactly one of ``choices`` (each literally)."""
    return "(" + "|".join(re.escape(c) for c in choices) + ")"


def _from_tuple(value: Any, where: str) -> StructuredOutput:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ValueError(f"{where}: expected a (kind, spec) pair with kind one of {KINDS}")
    kind, spec = value
    if kind not in KINDS:
        raise ValueError(f"{where}: kind {kind!r} is not one of {KINDS}")
    if kind == "json_schema":
        return StructuredOutput(kind, _schema_text(spec, where))
    if kind == "json_object":
        return StructuredOutput(kind, "")
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"{where}: a {kind} must be a non-empty string, got {spec!r}")
    return StructuredOutput(kind, spec)


def _from_vllm(value: Any, where: str) -> StructuredOutput:
    if isinstance(value, Mapping):
        unknown = sorted(set(map(str, value)) - set(VLLM_FIELDS))
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown}; supported: {VLLM_FIELDS}")
        value = StructuredOutputsParams(**value)
    if not isinstance(value, StructuredOutputsParams):
        raise ValueError(f"{where}: expected StructuredOutputsParams or a dict of its fields, "
                         f"got {type(value).__name__}")
    given = [f for f in VLLM_FIELDS if getattr(value, f) not in (None, False)]
    if len(given) != 1:
        raise ValueError(f"{where}: set exactly one of {VLLM_FIELDS}, got {given or 'none'}")
    f = given[0]
    if f == "json":
        return StructuredOutput("json_schema", _schema_text(value.json, where))
    if f == "json_object":
        return StructuredOutput("json_object", "")
    if f == "choice":
        ch = value.choice
        if isinstance(ch, str) or not isinstance(ch, Sequence) or not ch or not all(
                isinstance(c, str) and c for c in ch):
            raise ValueError(f"{where}: choice must be a non-empty list of non-empty strings, got {ch!r}")
        return StructuredOutput("regex", choice_regex(ch))
    return _from_tuple(("regex" if f == "regex" else "ebnf", getattr(value, f)), where)


def normalise(structured_output: Any = None, structured_outputs: Any = None,
              label: str = "SamplingParams") -> StructuredOutput | None:
    """The ``StructuredOutput`` of one request from DeepInfer's form (``structured_output``) or
    vLLM's (``structured_outputs``), or ``None`` without either. ``ValueError`` names ``label``
    and the field."""
    if structured_output is not None and structured_outputs is not None:
        raise ValueError(f"{label}: give structured_output or structured_outputs, not both")
    if isinstance(structured_output, StructuredOutput) or structured_output is None and structured_outputs is None:
        return structured_output
    if structured_output is not None:
        return _from_tuple(structured_output, f"{label}.structured_output")
    return _from_vllm(structured_outputs, f"{label}.structured_outputs")
