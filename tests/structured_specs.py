"""The structured-output corpus of tests/test_structured_output.py: 40 JSON schemas, 15 regexes
and 10 EBNF grammars, each with an independent validator of the generated text (``jsonschema``
for the schemas, Python's ``re`` for the regexes and, for every grammar, a hand-written regex
of the same language).

Every spec bounds its output (strings have ``maxLength``, arrays ``maxItems``, numbers a range,
repetitions a count) so that a random-weight model, which picks nearly uniformly among the
allowed tokens, still finishes within the tests' ``max_tokens``.
"""

from __future__ import annotations

S = {"type": "string", "maxLength": 6}
I = {"type": "integer", "minimum": 0, "maximum": 999}

SCHEMAS: list[dict] = [
    # flat objects, required vs optional
    {"type": "object", "properties": {"a": I}, "required": ["a"], "additionalProperties": False},
    {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"x": I, "y": I}, "required": ["x"], "additionalProperties": False},
    {"type": "object", "properties": {"flag": {"type": "boolean"}, "note": S}, "required": ["flag"],
     "additionalProperties": False},
    {"type": "object", "properties": {"v": {"type": "null"}}, "required": ["v"], "additionalProperties": False},
    {"type": "object", "properties": {"a": I, "b": S, "c": {"type": "boolean"}}, "required": [],
     "additionalProperties": False},
    # nested objects
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"id": I, "name": S},
                                               "required": ["id", "name"], "additionalProperties": False}},
     "required": ["user"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {
        "type": "object", "properties": {"c": I}, "required": ["c"], "additionalProperties": False}},
        "required": ["b"], "additionalProperties": False}}, "required": ["a"], "additionalProperties": False},
    {"type": "object", "properties": {"meta": {"type": "object", "properties": {"k": S, "n": I},
                                               "required": ["k"], "additionalProperties": False},
                                      "ok": {"type": "boolean"}},
     "required": ["meta", "ok"], "additionalProperties": False},
    # arrays with min / max items
    {"type": "array", "items": I, "minItems": 1, "maxItems": 3},
    {"type": "array", "items": S, "minItems": 2, "maxItems": 2},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "maxItems": 3}}, "required": ["tags"],
     "additionalProperties": False},
    {"type": "array", "items": {"type": "object", "properties": {"id": I}, "required": ["id"],
                                "additionalProperties": False}, "minItems": 1, "maxItems": 2},
    {"type": "array", "items": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}, "maxItems": 2},
    {"type": "array", "prefixItems": [I, S], "items": False, "minItems": 2},
    # enums and const
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
     "additionalProperties": False},
    {"enum": [1, 2, 3, "four", None]},
    {"type": "object", "properties": {"kind": {"const": "point"}, "x": I}, "required": ["kind", "x"],
     "additionalProperties": False},
    {"const": {"a": [1, 2]}},
    {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 4},
    # numbers with ranges
    {"type": "integer", "minimum": -50, "maximum": 50},
    {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
    {"type": "object", "properties": {"score": {"type": "integer", "minimum": 1, "maximum": 5}},
     "required": ["score"], "additionalProperties": False},
    {"type": "number", "minimum": 0, "maximum": 1},
    {"type": "object", "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                      "lon": {"type": "number", "minimum": -180, "maximum": 180}},
     "required": ["lat", "lon"], "additionalProperties": False},
    # string patterns, lengths and formats
    {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[a-f0-9]{4}$"}}, "required": ["code"],
     "additionalProperties": False},
    {"type": "string", "minLength": 2, "maxLength": 4},
    {"type": "string", "format": "date"},
    {"type": "string", "format": "uuid"},
    {"type": "string", "format": "ipv4"},
    {"type": "object", "properties": {"day": {"type": "string", "format": "date"}, "n": I},
     "required": ["day", "n"], "additionalProperties": False},
    # anyOf / oneOf
    {"anyOf": [I, {"type": "boolean"}]},
    {"type": "object", "properties": {"v": {"anyOf": [S, {"type": "null"}]}}, "required": ["v"],
     "additionalProperties": False},
    {"oneOf": [{"type": "object", "properties": {"cat": S}, "required": ["cat"], "additionalProperties": False},
               {"type": "object", "properties": {"dog": I}, "required": ["dog"], "additionalProperties": False}]},
    {"type": "array", "items": {"anyOf": [I, {"type": "null"}]}, "maxItems": 3},
    # $ref
    {"$defs": {"pt": {"type": "object", "properties": {"x": I, "y": I}, "required": ["x", "y"],
                      "additionalProperties": False}},
     "type": "object", "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}},
     "required": ["a", "b"], "additionalProperties": False},
    {"$defs": {"name": {"type": "string", "maxLength": 5}},
     "type": "array", "items": {"$ref": "#/$defs/name"}, "maxItems": 2},
    {"definitions": {"c": {"enum": ["x", "y"]}}, "type": "object",
     "properties": {"c": {"$ref": "#/definitions/c"}, "d": {"type": "array", "items": {"$ref": "#/definitions/c"},
                                                             "maxItems": 2}},
     "required": ["c"], "additionalProperties": False},
    # mixed: everything at once
    {"type": "object", "properties": {
        "id": {"type": "string", "format": "uuid"}, "level": {"enum": ["low", "high"]},
        "items": {"type": "array", "items": {"type": "object", "properties": {"q": I, "ok": {"type": "boolean"}},
                                             "required": ["q"], "additionalProperties": False}, "maxItems": 2},
        "extra": {"anyOf": [{"type": "null"}, S]}},
     "required": ["id", "level", "items"], "additionalProperties": False},
]

# (regex, the same regex for Python's re.fullmatch)
REGEXES: list[str] = [
    r"[0-9]{3}-[0-9]{4}",
    r"(yes|no|maybe)",
    r"[a-z]{1,8}",
    r"[A-Z][a-z]{0,5}",
    r"-?[0-9]{1,4}(\.[0-9]{1,2})?",
    r"[a-z]{1,5}@[a-z]{1,5}\.(com|org)",
    r"#[0-9a-f]{6}",
    r"(0|1){4,8}",
    r"\d{4}-\d{2}-\d{2}",
    r"[a-z_][a-z0-9_]{0,7} = [0-9]{1,3}",
    r"(foo|bar)(,(foo|bar)){0,3}",
    r"v[0-9]\.[0-9]{1,2}\.[0-9]{1,2}",
    r"\((x|y)\+(x|y)\)",
    r"[ACGT]{5,10}",
    r"(True|False|None)",
]

# (EBNF grammar with start rule ``root``, a Python regex of the same language)
GRAMMARS: list[tuple[str, str]] = [
    ('root ::= "yes" | "no"', r"(yes|no)"),
    ('root ::= digit digit? digit?\ndigit ::= [0-9]', r"[0-9]{1,3}"),
    ('root ::= "(" item ("," item){0,3} ")"\nitem ::= [a-z]', r"\([a-z](,[a-z]){0,3}\)"),
    ('root ::= key "=" val\nkey ::= [a-z]{1,4}\nval ::= [0-9]{1,3}', r"[a-z]{1,4}=[0-9]{1,3}"),
    ('root ::= "[" (num ("," num){0,2})? "]"\nnum ::= "-"? [1-9] [0-9]{0,2}', r"\[(-?[1-9][0-9]{0,2}(,-?[1-9][0-9]{0,2}){0,2})?\]"),
    ('root ::= greet " " name "!"\ngreet ::= "hi" | "hello"\nname ::= [A-Z] [a-z]{0,5}', r"(hi|hello) [A-Z][a-z]{0,5}!"),
    ('root ::= term (op term){0,2}\nterm ::= [0-9] | "(" [0-9] op [0-9] ")"\nop ::= "+" | "*"',
     r"([0-9]|\([0-9][+*][0-9]\))([+*]([0-9]|\([0-9][+*][0-9]\))){0,2}"),
    ('root ::= "def " ident "(" ident? "):"\nident ::= [a-z] [a-z0-9_]{0,5}',
     r"def [a-z][a-z0-9_]{0,5}\(([a-z][a-z0-9_]{0,5})?\):"),
    ('root ::= bool (" and " bool){0,2}\nbool ::= "true" | "false"', r"(true|false)( and (true|false)){0,2}"),
    ('root ::= "<" tag ">" [a-z]{0,6} "</" tag ">"\ntag ::= "b" | "i"', r"<(b|i)>[a-z]{0,6}</(b|i)>"),
]
