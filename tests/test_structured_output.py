"""Structured output with xgrammar (FEATURES §8), on the CPU.

* The forms (DeepInfer's ``structured_output=(kind, spec)``, vLLM's ``structured_outputs``),
  their normalisation and their errors; the package imports and ``SamplingParams`` validates
  without xgrammar, and asking for structured output then names the ``[grammar]`` extra.
* The masks: the jitted sampler and the draft verifier never emit a masked id; a matcher's
  draft rows roll back.
* End to end: the corpus of tests/structured_specs.py (40 JSON schemas, 15 regexes, 10 EBNF
  grammars) generated greedy and sampled (two seeds) on a random-weight model (the shipped
  model's config and BPE tokenizer, random weights) and on the shipped trained model, with and
  without DSpark speculation: every output validates (``jsonschema`` for the schemas, Python's
  ``re`` for the regexes and for the grammars' equivalent regexes). One engine per (model,
  speculation), one ``generate`` call per (engine, greedy / sampled): every request of the
  corpus in one batch. The full matrix runs with ``-m slow``; the default run has two fast twins
  (see ``CASES``).

xgrammar is imported unconditionally: without it this module fails, it is never skipped.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import jsonschema
import numpy as np
import pytest
import xgrammar  # noqa: F401  (the [grammar] extra must be installed: a missing one fails here)

from deepinfer_jax import LLM, SamplingParams, StructuredOutputsParams
from deepinfer_jax.models.registry import DEFAULT_MODEL, resolve_model
from deepinfer_jax.sampling.grammar_spec import StructuredOutput, normalise
from deepinfer_jax.sampling.params import sampling_params_from_dict

sys.path.insert(0, os.path.dirname(__file__))
from structured_specs import GRAMMARS, REGEXES, SCHEMAS  # noqa: E402

MAX_TOKENS = 128
ENGINE = dict(max_num_seqs=64, max_num_batched_tokens=256, token_buckets=(256,), max_model_len=192,
              progress=False)
PROMPTS = ["config = ", "def parse(data):\n    return ", "# answer\n", "x = [", "import json\n"]
SEEDS = (11, 12)


# --------------------------------------------------------------------------- forms


def test_forms_normalise_to_one_key():
    import pydantic

    class Point(pydantic.BaseModel):
        x: int
        y: int

    schema = Point.model_json_schema()
    a = normalise(("json_schema", schema))
    assert a == normalise(("json_schema", json.dumps(schema, indent=2)))
    assert a == normalise(("json_schema", Point))
    assert a == normalise(structured_outputs=StructuredOutputsParams(json=schema))
    assert a == normalise(structured_outputs={"json": Point})
    assert normalise(("regex", "a+")) == StructuredOutput("regex", "a+")
    assert normalise(structured_outputs={"grammar": 'root ::= "x"'}) == StructuredOutput("ebnf", 'root ::= "x"')
    assert normalise(structured_outputs={"json_object": True}) == StructuredOutput("json_object", "")
    ch = normalise(structured_outputs={"choice": ["a.b", "c"]})
    assert ch.kind == "regex" and re.fullmatch(ch.text, "a.b") and not re.fullmatch(ch.text, "axb")
    p = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[0-9]+")).validate()
    assert p.grammar == StructuredOutput("regex", "[0-9]+") and p.structured_outputs is None
    q = sampling_params_from_dict({"max_tokens": 4, "structured_outputs": {"json": schema, "regex": None}}, 2)
    assert q.grammar == a
    assert SamplingParams().validate().grammar is None


@pytest.mark.parametrize("kwargs,match", [
    (dict(structured_output=("yaml", "x")), r"request 3: SamplingParams\.structured_output: kind 'yaml'"),
    (dict(structured_output="x"), r"request 3: SamplingParams\.structured_output: expected a \(kind, spec\)"),
    (dict(structured_output=("json_schema", "{not json")), r"structured_output: the JSON schema string is not valid JSON"),
    (dict(structured_output=("json_schema", 5)), r"must be a dict, a pydantic model class or a JSON string"),
    (dict(structured_output=("regex", "")), r"a regex must be a non-empty string"),
    (dict(structured_outputs=StructuredOutputsParams(regex="a", grammar="b")), r"set exactly one of"),
    (dict(structured_outputs={"jsn": {}}), r"unknown field\(s\) \['jsn'\]"),
    (dict(structured_outputs={"choice": []}), r"choice must be a non-empty list"),
    (dict(structured_output=("regex", "a"), structured_outputs={"regex": "a"}), r"not both"),
])
def test_form_errors_name_the_request_and_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs).validate(3)


def test_package_imports_without_xgrammar():
    """With xgrammar unimportable the package, SamplingParams and the normalisation work; the
    compiler raises ValueError naming the [grammar] extra."""
    code = (
        "import sys; sys.modules['xgrammar'] = None\n"
        "import deepinfer_jax\n"
        "from deepinfer_jax import SamplingParams\n"
        "p = SamplingParams(structured_output=('regex', 'a+')).validate(0)\n"
        "from deepinfer_jax.sampling.grammar_compile import require_xgrammar\n"
        "try:\n    require_xgrammar()\nexcept ValueError as e:\n    print('ERR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode == 0, out.stderr
    assert "ERR structured output needs xgrammar, the [grammar] extra" in out.stdout


# --------------------------------------------------------------------------- masks


def test_sampler_and_verifier_respect_the_bitmask():
    import jax.numpy as jnp

    from deepinfer_jax.sampling.sampler import build_sampling_batch, sample
    from deepinfer_jax.sampling.spec_verify import verify_drafts

    R, V, K = 4, 70, 2
    W = -(-V // 32)
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(R, V)).astype(np.float32)
    allowed = [sorted(rng.choice(V, size=5, replace=False).tolist()) for _ in range(R)]
    mask = np.zeros((R, W), np.int32)
    for r, ids in enumerate(allowed):
        for v in ids:
            mask[r, v // 32] |= np.int32(np.uint32(1 << (v % 32)).view(np.int32))
    rows = [(SamplingParams(temperature=t), 7 + r, 3) for r, t in enumerate((0.0, 1.0, 1.0, 0.0))]
    sb = build_sampling_batch(rows, R, V)
    out = sample(jnp.asarray(logits), sb, 0, jnp.asarray(mask))
    assert all(int(t) in allowed[r] for r, t in enumerate(out.token_ids))
    # greedy row 0: the argmax of the logits is masked out -> never taken as a draft
    top = int(np.argmax(logits[0]))
    logits_RKV = np.repeat(logits[:, None], K + 1, axis=1)
    draft = np.full((R, K), top, np.int32)
    mask_RKW = np.repeat(mask[:, None], K + 1, axis=1)
    ver = verify_drafts(jnp.asarray(logits_RKV), jnp.asarray(draft), jnp.full((R,), K, jnp.int32), sb,
                        jnp.asarray(mask_RKW))
    for r in range(R):
        emitted = [int(t) for t in ver.token_ids[r, :int(ver.num_emitted[r])]]
        assert all(t in allowed[r] for t in emitted), (r, emitted, allowed[r])


def test_draft_rows_roll_back():
    from deepinfer_jax.sampling.grammar_compile import GrammarCompiler
    from deepinfer_jax.sampling.grammar_matcher import GrammarState
    from deepinfer_jax.tokenizer.loader import load_tokenizer

    d = resolve_model(DEFAULT_MODEL, progress=False)
    comp = GrammarCompiler(os.path.join(d, "tokenizer.json"), 8192, [1])
    (cg,) = comp.compile_all([(0, normalise(("regex", "ab(c|d)e")))])
    g = GrammarState(comp.matcher(cg), comp.words, max_drafts=3)
    tok = load_tokenizer(d)
    a, b, x = (tok.tokenizer.token_to_id(s) for s in ("a", "b", "x"))
    g.prepare(())
    row0 = g.mask_KW[0].copy()
    g.prepare((a, b, x))  # x breaks the grammar: rows after it stay empty
    assert (g.mask_KW[0] == row0).all()
    assert g.mask_KW[1].any() and g.mask_KW[2].any() and not g.mask_KW[3].any()
    g.prepare(())
    assert (g.mask_KW[0] == row0).all()  # the matcher was rolled back
    # a draft that is EOS where the grammar may end: accepted, nothing after it, rolled back
    (cg2,) = comp.compile_all([(0, normalise(("regex", "a")))])
    h = GrammarState(comp.matcher(cg2), comp.words, max_drafts=3)
    h.prepare((a, 1, a))
    assert h.mask_KW[1].view(np.uint32)[0] >> 1 & 1 and not h.mask_KW[2].any() and not h.mask_KW[3].any()
    assert not h.terminated
    g.advance([a])
    assert not (g.rows(0) == row0).all()


def test_json_rows_never_allow_control_bytes():
    """xgrammar 0.2.9 admits raw control bytes in strings with maxLength (invalid JSON): the
    JSON kinds AND a control-free mask into every row; regexes keep their own alphabet."""
    from deepinfer_jax.sampling.grammar_compile import GrammarCompiler
    from deepinfer_jax.sampling.grammar_matcher import GrammarState

    d = resolve_model(DEFAULT_MODEL, progress=False)
    comp = GrammarCompiler(os.path.join(d, "tokenizer.json"), 8192, [1])
    so = normalise(("json_schema", {"type": "string", "maxLength": 6}))
    (cg,) = comp.compile_all([(0, so)])
    ctrl = 210  # the byte-level token of byte 0x12
    assert comp.matcher(cg).accept_string('"a\x12')  # xgrammar's own rule admits it
    m = comp.matcher(cg)
    assert m.accept_string('"a')
    g = GrammarState(m, comp.words, 0, comp.extra_mask(so))
    g.prepare(())
    words = g.mask_KW[0].view(np.uint32)
    assert not (words[ctrl // 32] >> (ctrl % 32)) & 1
    assert words.any()
    assert comp.extra_mask(normalise(("regex", "a"))) is None


# --------------------------------------------------------------------------- end to end


# xgrammar's formats are syntactic where Python's checkers are stricter (FEATURES §8, known
# limits): "date" allows day 01-31 in every month ("2021-11-31"), "ipv4" allows leading zeros
# ("038.1.2.3", which Python's ipaddress refuses). Those two are checked the same way here, every
# other format by jsonschema's own checkers.
DATE_SYNTAX = re.compile(r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])")
IPV4_SYNTAX = re.compile(r"(\d{1,3})\.(\d{1,3})\.(\d{1,3})\.(\d{1,3})")


def _ipv4(v) -> bool:
    m = IPV4_SYNTAX.fullmatch(v) if isinstance(v, str) else None
    return not isinstance(v, str) or (m is not None and all(int(x) <= 255 for x in m.groups()))


def format_checker() -> jsonschema.FormatChecker:
    fmt = jsonschema.FormatChecker()
    fmt.checks("date")(lambda v: not isinstance(v, str) or DATE_SYNTAX.fullmatch(v) is not None)
    fmt.checks("ipv4")(_ipv4)
    return fmt


def corpus():
    """(label, SamplingParams kwargs, validator) of every spec of the corpus."""
    fmt = format_checker()
    out = []
    for i, s in enumerate(SCHEMAS):
        def check(text, s=s):
            jsonschema.validate(json.loads(text), s, format_checker=fmt)
        out.append((f"schema{i}", dict(structured_output=("json_schema", s)), check))
    for i, r in enumerate(REGEXES):
        def check(text, r=r):
            assert re.fullmatch(r, text), f"{text!r} does not match {r!r}"
        out.append((f"regex{i}", dict(structured_outputs=StructuredOutputsParams(regex=r)), check))
    for i, (g, r) in enumerate(GRAMMARS):
        def check(text, r=r):
            assert re.fullmatch(r, text), f"{text!r} is not in the grammar's language {r!r}"
        out.append((f"ebnf{i}", dict(structured_output=("ebnf", g)), check))
    return out


@pytest.fixture(scope="module")
def random_model_dir(tmp_path_factory):
    """The shipped model's config and BPE tokenizer with random weights."""
    from deepinfer_jax.checkpoint.random_checkpoint import write_random_checkpoint
    from deepinfer_jax.config import ModelConfig

    src = resolve_model(DEFAULT_MODEL, progress=False)
    d = tmp_path_factory.mktemp("random_bpe")
    write_random_checkpoint(ModelConfig.from_json(src), d, seed=5, tokenizer=False, progress=False)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(src, f), d / f)
    return str(d)


@pytest.fixture(scope="module")
def llm(request, random_model_dir):
    model, spec = request.param
    kw = dict(spec_decode="dspark", spec_varlen=False) if spec else {}
    return LLM(random_model_dir if model == "random" else DEFAULT_MODEL, **ENGINE, **kw)


def _case(model: str, spec: bool, mode: str, seeds, slow: bool):
    name = f"{model}{'-dspark' if spec else ''}-{mode}{'' if slow else '-fast'}"
    return pytest.param((model, spec), mode, seeds, id=name, marks=[pytest.mark.slow] if slow else [])


# The whole matrix (model x speculation x greedy / sampled with two seeds) is marked slow; the
# default run keeps its two fast twins: the trained model greedy without speculation (the plain
# sampler's mask) and the random model sampled with DSpark (bitmask rows per draft slot, the
# verifier's mask, rollback of rejected drafts), one seed.
CASES = [_case("trained", False, "greedy", (None,), slow=False),
         _case("random", True, "sampled", SEEDS[:1], slow=False)] + [
    _case(m, sp, mode, (None,) if mode == "greedy" else SEEDS, slow=True)
    for m in ("random", "trained") for sp in (False, True) for mode in ("greedy", "sampled")]


@pytest.mark.parametrize("llm,mode,seeds", CASES, indirect=["llm"])
def test_every_output_validates(llm, mode, seeds):
    if mode == "greedy":
        check_bad_grammar_is_refused(llm)
    specs = corpus()
    jobs, prompts, params = [], [], []
    for seed in seeds:
        for j, (label, kw, check) in enumerate(specs):
            t = 0.0 if seed is None else 1.0
            jobs.append((f"{label}/seed={seed}", check))
            prompts.append(PROMPTS[j % len(PROMPTS)])
            params.append(SamplingParams(temperature=t, seed=seed, max_tokens=MAX_TOKENS, **kw))
    outs = llm.generate(prompts, params, use_tqdm=False)
    bad = []
    for (label, check), o in zip(jobs, outs):
        c = o.outputs[0]
        try:
            assert c.finish_reason == "stop", f"finish_reason={c.finish_reason} after {len(c.token_ids)} tokens"
            check(c.text)
        except Exception as e:
            bad.append(f"{label}: {c.text!r}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    assert not bad, f"{len(bad)} of {len(outs)} outputs invalid:\n" + "\n".join(bad)
    if llm.engine.spec:
        assert llm.stats.summary()["drafts_verified"] > 0


def check_bad_grammar_is_refused(llm):
    """A grammar that does not compile raises ValueError naming the request before any device
    work; nothing of the batch is queued and the engine stays usable."""
    with pytest.raises(ValueError, match=r"request 1: SamplingParams\.structured_output=\('regex', 'a\(b'\): "
                                         r"does not compile: .*parenthesis"):
        llm.generate(["a", "b", "c"], [SamplingParams(max_tokens=2),
                                      SamplingParams(structured_output=("regex", "a(b")),
                                      SamplingParams(structured_output=("json_schema", {"type": "object"}))],
                     use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert not llm.engine.scheduler.waiting and not llm.engine.scheduler.running
