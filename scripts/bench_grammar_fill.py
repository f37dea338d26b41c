"""Structured output: host time to fill one step's bitmask rows, against the device step.

Part 1 (host only): R grammar states (JSON schemas, regexes, an EBNF grammar, cycled) on the
shipped model's tokenizer; one "step" = what the engine does per row after a step's results:
advance the matcher on the emitted token and fill the next step's bitmask rows
(``GrammarState.advance`` + ``prepare``), with K drafts per row for DSpark (K + 1 rows filled,
then rolled back). Tokens are picked from the mask (the lowest allowed id, or EOS when the
grammar is done, after which the state restarts), so every row stays inside its grammar.

Part 2 (device step, unless ``--no-step``): the p50 time of one decode step of the shipped model
at R rows on this machine's JAX backend (plain rows, no grammar), from an engine run; and one
engine run with R grammar requests in async mode, reporting its fill time per step
(``LLMEngine.grammar_fill_s``) next to its step time.

Usage: ``python scripts/bench_grammar_fill.py [--rows 64 256] [--drafts 0 2] [--steps 50] [--out f.json]``
Prints a table and writes JSON (default ``benchmarks/results/grammar_fill_<platform>.json``,
with the platform, jax and xgrammar versions and the date).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                      "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}},
                                "required": ["id"], "additionalProperties": False}, "maxItems": 8},
    {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                      "required": ["x", "y"], "additionalProperties": False}},
     "type": "object", "properties": {"a": {"$ref": "#/$defs/pt"}, "label": {"type": "string", "maxLength": 20}},
     "required": ["a"], "additionalProperties": False},
]
SPECS = ([("json_schema", s) for s in SCHEMAS]
         + [("regex", r"[a-z]{1,10}@[a-z]{1,10}\.(com|org)"), ("regex", r"\d{4}-\d{2}-\d{2}"),
            ("ebnf", 'root ::= "(" item ("," item){0,5} ")"\nitem ::= [a-z]{1,4} | [0-9]{1,3}'),
            ("json_object", None)])


def lowest_allowed(mask_W: np.ndarray) -> int:
    words = mask_W.view(np.uint32)
    w = int(np.flatnonzero(words)[0])
    return w * 32 + (int(words[w]) & -int(words[w])).bit_length() - 1


def draft_chain(g, k: int) -> list[int]:
    """Up to ``k`` drafts the grammar accepts from the state's position (then rolled back)."""
    m, out = g.matcher, []
    scratch = np.zeros((1, g.words), np.int32)
    for _ in range(k):
        if m.is_terminated():
            break
        m.fill_next_token_bitmask(scratch, 0)
        t = lowest_allowed(scratch[0])
        if not m.accept_token(t):
            break
        out.append(t)
    if out:
        m.rollback(len(out))
    return out


def host_fill(rows: int, drafts: int, steps: int, model_dir: str, eos: int, vocab: int) -> dict:
    from deepinfer_jax.sampling.grammar_compile import GrammarCompiler
    from deepinfer_jax.sampling.grammar_matcher import GrammarState
    from deepinfer_jax.sampling.grammar_spec import normalise

    comp = GrammarCompiler(os.path.join(model_dir, "tokenizer.json"), vocab, [eos])
    sos = [normalise(SPECS[i % len(SPECS)]) for i in range(rows)]
    compiled = comp.compile_all(list(enumerate(sos)))

    def fresh(i):
        g = GrammarState(comp.matcher(compiled[i]), comp.words, drafts)
        g.prepare(())
        return g

    states = [fresh(i) for i in range(rows)]
    times, filled = [], []
    for _ in range(steps):
        picks = [lowest_allowed(g.mask_KW[0]) for g in states]  # the "sampled" tokens (not timed)
        t0 = time.perf_counter()
        for i, g in enumerate(states):
            g.advance([picks[i]])
        dt = time.perf_counter() - t0
        chains = [draft_chain(g, drafts) for g in states]  # drafts the grammar accepts (not timed)
        t0 = time.perf_counter()
        for g, c in zip(states, chains):
            if not g.terminated:
                g.prepare(c)
        times.append(dt + time.perf_counter() - t0)
        filled.append(sum(len(c) + 1 for g, c in zip(states, chains) if not g.terminated))
        for i, g in enumerate(states):
            if g.terminated:
                states[i] = fresh(i)
    return {"rows": rows, "drafts": drafts, "steps": steps, "mask_rows_per_step": statistics.fmean(filled),
            "fill_ms_p50": 1e3 * statistics.median(times), "fill_ms_mean": 1e3 * statistics.fmean(times),
            "fill_ms_max": 1e3 * max(times), "us_per_row": 1e6 * statistics.median(times) / rows}


def device_step(rows: int) -> dict:
    from deepinfer_jax import LLM, SamplingParams

    T = max(rows, 64)
    llm = LLM(max_num_seqs=rows, max_num_batched_tokens=T * 2, token_buckets=(T * 2,), max_model_len=128,
              progress=False)
    prompts = [f"x{i} = " for i in range(rows)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    plain = llm.stats.summary()["step_time_p50_s"]
    eng = llm.engine
    eng.grammar_fill_s = eng.grammar_plan_s = 0.0
    sp = [SamplingParams(temperature=1.0, seed=i, max_tokens=24,
                         structured_output=(k, s) if s is not None else (k, None))
          for i, (k, s) in enumerate(SPECS[j % len(SPECS)] for j in range(rows))]
    llm.generate(prompts, sp, use_tqdm=False)
    s = llm.stats.summary()
    steps = max(s["steps"], 1)
    return {"rows": rows, "device_step_ms_p50": 1e3 * plain, "grammar_run_step_ms_p50": 1e3 * s["step_time_p50_s"],
            "grammar_run_steps": s["steps"], "grammar_run_fill_ms_per_step": 1e3 * eng.grammar_fill_s / steps,
            "grammar_run_plan_ms_per_step": 1e3 * eng.grammar_plan_s / steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--drafts", type=int, nargs="+", default=[0, 2])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--no-step", action="store_true", help="skip the device-step part")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.models.registry import DEFAULT_MODEL, resolve_model

    d = resolve_model(DEFAULT_MODEL, progress=False)
    cfg = ModelConfig.from_json(d)
    fill = [host_fill(r, k, a.steps, d, cfg.eos_token_id, cfg.vocab_size) for r in a.rows for k in a.drafts]
    print(f"bitmask fill per step (vocab {cfg.vocab_size}, advance + fill of every row)")
    print(f"{'rows':>5} {'drafts':>6} {'masks':>6} {'p50 ms':>8} {'mean ms':>8} {'max ms':>8} {'us/row':>7}")
    for f in fill:
        print(f"{f['rows']:>5} {f['drafts']:>6} {f['mask_rows_per_step']:>6.0f} {f['fill_ms_p50']:>8.2f} {f['fill_ms_mean']:>8.2f} "
              f"{f['fill_ms_max']:>8.2f} {f['us_per_row']:>7.1f}")
    steps = []
    if not a.no_step:
        import jax

        steps = [device_step(r) for r in a.rows]
        print(f"device step on {jax.default_backend()} (shipped model, decode) and an async grammar run")
        print(f"{'rows':>5} {'step p50 ms':>12} {'grammar-run step ms':>20} {'fill ms/step':>13} {'plan ms/step':>13}")
        for s in steps:
            print(f"{s['rows']:>5} {s['device_step_ms_p50']:>12.2f} {s['grammar_run_step_ms_p50']:>20.2f} "
                  f"{s['grammar_run_fill_ms_per_step']:>13.2f} {s['grammar_run_plan_ms_per_step']:>13.2f}")
    import datetime
    from importlib.metadata import version

    import jax

    out = a.out or os.path.join("benchmarks", "results", f"grammar_fill_{jax.default_backend()}.json")
    meta = {"platform": jax.default_backend(), "device": str(jax.devices()[0].device_kind),
            "cpu_count": os.cpu_count(), "jax": jax.__version__, "xgrammar": version("xgrammar"),
            "date": datetime.date.today().isoformat()}
    with open(out, "w") as f:
        json.dump({"meta": meta, "fill": fill, "device_step": steps}, f, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
