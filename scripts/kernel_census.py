#!/usr/bin/env python3
"""Which source lines a jitted engine step's kernels come from: a census of the compiled
program, joined with a profiler trace's device time.

On the GPU a small model's decode step is launch-bound: about a thousand kernels, each costing
microseconds of launch and gap whatever its work, while the device idles most of the step
(``bench_spec.py --trace-steps``). To cut that count, you first need to know which code emits
the kernels. This script compiles the engine's step at one bucket and reads XLA's optimized
HLO. Every instruction the executable launches is one kernel: a fusion, a custom call (a Pallas
kernel, a library GEMM), a copy, a sort. Bodies of loops with a known trip count count once per
trip. A called computation counts its own kernels, except XLA:CPU's inlined small calls, which
count as one. Parameters, tuples, bitcasts and constants launch nothing. Each kernel gets the
Python source the HLO's metadata names (the innermost frame of its root op's stack). The script
counts them per function, per model part and per file. With ``--trace-steps N`` it then runs C
requests, traces N decode steps with ``jax.profiler``, and adds each function's device
milliseconds and traced kernels per step.

    python scripts/kernel_census.py                                  # shipped model, C = 16, no speculation
    python scripts/kernel_census.py --spec --concurrency 60 --trace-steps 8 \\
        --out benchmarks/results/kernel_census_H100.json

On a CPU the "kernels" are XLA's thunks and the kernels run as their jnp references, so the
counts only say where the code's ops are, not what a GPU launches. On a GPU, a sort may launch
several library kernels and counts as one here; the trace's counts are the real ones.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import re
import sys
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # step_profile

# instructions that launch nothing
NO_LAUNCH = {"parameter", "get-tuple-element", "bitcast", "constant", "tuple", "after-all", "partition-id",
             "replica-id", "opt-barrier"}
# "%name = type op(": a tuple type may nest one level and hold /*index=N*/ comments
_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (?:\((?:[^()]|\([^()]*\))*\)|\S+) ([\w\-]+)\(")
_FRAME = re.compile(r"stack_frame_id=(\d+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
PACKAGE = "deepinfer_jax/"


def _table(text: str, name: str) -> list[str]:
    """The lines of one of the module's tables (FileNames, FunctionNames, ...) after its header."""
    m = re.search(rf"^{name}$", text, re.M)
    if m is None:
        return []
    out = []
    for line in text[m.end() + 1:].split("\n"):
        if not line.strip():
            break
        out.append(line)
    return out


def stack_frames(text: str) -> dict[int, tuple[str, str, int, int]]:
    """``frame id -> (file, function, line, parent frame id or 0)`` from the HLO module's
    stack-frame tables (the text prints a frame's parent id plus one; 1 means none)."""
    files = {int(k): v.strip('"') for k, v in (ln.split(" ", 1) for ln in _table(text, "FileNames"))}
    funcs = {int(k): v.strip('"') for k, v in (ln.split(" ", 1) for ln in _table(text, "FunctionNames"))}
    locs = {}
    for ln in _table(text, "FileLocations"):
        d = dict(re.findall(r"(\w+)=(\d+)", ln))
        locs[int(ln.split(" ", 1)[0])] = (files[int(d["file_name_id"])], funcs[int(d["function_name_id"])],
                                          int(d["line"]))
    frames = {}
    for ln in _table(text, "StackFrames"):
        d = dict(re.findall(r"(\w+)=(\d+)", ln))
        frames[int(ln.split(" ", 1)[0])] = (*locs[int(d["file_location_id"])], int(d["parent_frame_id"]) - 1)
    return frames


def short_file(path: str) -> str:
    """A path inside the package as ``layers/moe.py``; others as their base name."""
    return path.split(PACKAGE, 1)[1] if PACKAGE in path else os.path.basename(path)


def computations(text: str) -> dict[str, list[str]]:
    """``name -> instruction lines`` of every computation in the module; the entry one is
    also under ``"ENTRY"``."""
    comps, name, body = {}, None, []
    for line in text.split("\n"):
        m = re.match(r"^(ENTRY )?%([\w.\-]+) .*\{\s*$", line)
        if m and name is None:
            name, body = m.group(2), []
            if m.group(1):
                comps["ENTRY"] = body
            continue
        if name is not None:
            if line.startswith("}"):
                comps[name] = body
                name = None
            else:
                body.append(line)
    return comps


def launched(text: str) -> list[dict]:
    """The instructions the executable launches: ``{name, op, frame, times}``, where ``times``
    is how often one run launches it (loop bodies: their known trip count, else 1)."""
    comps = computations(text)
    if "ENTRY" not in comps:
        raise ValueError("no ENTRY computation in the HLO text")
    out = []

    def walk(lines, times, depth):
        for line in lines:
            m = _INSTR.match(line)
            if m is None:
                continue
            name, op = m.groups()
            if op in NO_LAUNCH or op.endswith("-done"):  # (an async pair's start launched it)
                continue
            f = _FRAME.search(line)
            # XLA:CPU runs a small callee inline, as one thunk
            inline = op == "call" and 'xla_cpu_small_call="true"' in line
            if op in ("while", "conditional", "call") and depth < 8 and not inline:
                trip = _TRIP.search(line)
                n = int(trip.group(1)) if (op == "while" and trip) else 1
                # a loop's condition and body run each trip; a call's or a branch's callee once
                for key in ("condition", "body", "to_apply", "true_computation", "false_computation"):
                    for callee in re.findall(rf"\b{key}=%([\w.\-]+)", line):
                        walk(comps.get(callee, []), times * n, depth + 1)
                for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
                    for callee in re.findall(r"%([\w.\-]+)", group):
                        walk(comps.get(callee, []), times, depth + 1)
                if op != "while":
                    continue
            out.append(dict(name=name, op=op, frame=int(f.group(1)) if f else 0, times=times))
    walk(comps["ENTRY"], 1, 0)
    return out


# the rooms whose functions are the model's parts; the helpers under base/ and the kernels'
# references are called from them
CALLER_ROOMS = ("layers/", "models/", "sampling/", "runner/")


def caller(frames: dict, frame_id: int) -> str:
    """``file:function`` of the innermost frame of this stack in one of ``CALLER_ROOMS`` (the
    model part a helper's op belongs to), else of the innermost frame."""
    fid, first = frame_id, None
    for _ in range(64):
        fr = frames.get(fid)
        if fr is None:
            break
        name = f"{short_file(fr[0])}:{fr[1]}"
        first = first or name
        if PACKAGE in fr[0] and short_file(fr[0]).startswith(CALLER_ROOMS):
            return name
        fid = fr[3]
    return first or "(no metadata)"


def census(text: str, top: int = 40) -> dict:
    """Kernels per run of the compiled program, by opcode, by innermost source function, by the
    model part that called it (``caller``) and by file (``file:function`` as the HLO metadata
    names it; ``(no metadata)`` where XLA made the op itself, e.g. a layout copy)."""
    frames = stack_frames(text)
    instrs = launched(text)
    by_op, by_fn, by_caller, by_file = (collections.Counter() for _ in range(4))
    where = {}
    for ins in instrs:
        fr = frames.get(ins["frame"])
        fn = f"{short_file(fr[0])}:{fr[1]}" if fr else "(no metadata)"
        where[ins["name"]] = fn
        by_op[ins["op"]] += ins["times"]
        by_fn[fn] += ins["times"]
        by_caller[caller(frames, ins["frame"])] += ins["times"]
        by_file[fn.split(":", 1)[0]] += ins["times"]
    return dict(kernels=sum(i["times"] for i in instrs), by_op=dict(by_op.most_common()),
                by_function=dict(by_fn.most_common(top)), by_caller=dict(by_caller.most_common(top)),
                by_file=dict(by_file.most_common(top)), functions=len(by_fn), where=where)


def join_trace(events, where: dict, steps: int) -> dict:
    """Per source function: traced kernels and device ms per step, for trace events
    ``(name, hlo_op, start_ns, duration_ns)`` (``step_profile.kernel_events``); an event is
    matched by its ``hlo_op``, else by its name, to an instruction of the census."""
    kernels, ns = collections.Counter(), collections.Counter()
    lost_n, lost_ns = collections.Counter(), collections.Counter()  # unmatched, by (kernel name, hlo op)
    matched = 0
    for name, op, _start, dur in events:
        fn = where.get(op) or where.get(name) or where.get(re.sub(r"_(\d+)$", r".\1", name))
        if fn is None:
            fn = "(not in the census)"
            lost_n[(name, op)] += 1
            lost_ns[(name, op)] += dur
        else:
            matched += 1
        kernels[fn] += 1
        ns[fn] += dur
    per = max(steps, 1)
    rows = [dict(function=fn, kernels_per_step=kernels[fn] / per, ms_per_step=ns[fn] * 1e-6 / per)
            for fn, _ in ns.most_common()]
    # what the unmatched events are (library kernels carry their own names), the costliest first
    unmatched = [dict(kernel=name, hlo_op=op, kernels_per_step=lost_n[(name, op)] / per,
                      ms_per_step=d * 1e-6 / per) for (name, op), d in lost_ns.most_common(25)]
    return dict(steps=steps, events=len(events), matched_fraction=matched / len(events) if events else 0.0,
                by_function=rows, unmatched=unmatched)


def traced_events(llm, prompts, sp, steps: int) -> tuple[list, list, int]:
    """Run ``prompts``; once a processed step had no prompt token and nothing waits, trace the
    next ``steps`` steps. Returns (kernel events, the variants dispatched while tracing, steps
    traced)."""
    import step_profile

    runner = llm.engine.runner
    seen = None  # the variants dispatched, once tracing starts
    orig = runner.buckets_of

    def record(sched):
        v = orig(sched)
        if seen is not None:
            seen.append(v)
        return v

    def start():
        nonlocal seen
        seen = []

    runner.buckets_of = record
    try:
        events, traced = step_profile.trace_engine_decode(llm.engine, prompts, sp, steps, prefix="kernel_census",
                                                          on_trace=start)
    finally:
        del runner.buckets_of  # the class's method again
    return events, seen, len(traced)


def compiled_text(llm, variant) -> str:
    """The optimized HLO text of the engine's step at bucket ``variant`` (T, R, Td)."""
    import jax

    from deepinfer_jax.runner.model_runner import _empty_step

    runner = llm.engine.runner
    sched = _empty_step()
    bufs, layout = runner.step_inputs(sched, *variant)
    fn, args, kw = runner.step_call(bufs, layout, sched.wants_prompt_logprobs)
    with jax.set_mesh(runner.trace_mesh):
        return fn.lower(*args, **kw).compile().as_text()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model dir or name (default: the shipped model)")
    ap.add_argument("--concurrency", type=int, default=16, help="decode rows C (max_num_seqs; default 16)")
    ap.add_argument("--spec", action="store_true", help="DSpark on: the verification step of C rows x (K+1) tokens")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--engine", default="{}", help="JSON of further EngineConfig fields")
    ap.add_argument("--trace-steps", type=int, default=0, metavar="N",
                    help="also trace N decode steps of C requests and join the device time per function")
    ap.add_argument("--top", type=int, default=40, help="functions and files listed (default 40)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/kernel_census_<platform>.json)")
    args = ap.parse_args(argv)
    for flag, v, lo in (("--concurrency", args.concurrency, 1), ("--input-len", args.input_len, 1),
                        ("--output-len", args.output_len, 1), ("--trace-steps", args.trace_steps, 0),
                        ("--top", args.top, 1)):
        if v < lo:
            ap.error(f"{flag}: {v} must be >= {lo}")
    extra = json.loads(args.engine)
    if not isinstance(extra, dict):
        ap.error(f"--engine: {args.engine!r} is not a JSON object")

    import jax
    import numpy as np

    from deepinfer_jax import LLM, SamplingParams
    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.models.registry import DEFAULT_MODEL, resolve_model

    model = args.model or DEFAULT_MODEL
    cfg = ModelConfig.from_json(resolve_model(model, progress=False))
    C = args.concurrency
    K = cfg.dspark_block_size if args.spec else 0
    T = (K + 1) * C  # the full decode step's tokens
    chunk = max(512, T)
    kw = dict(max_num_seqs=C, max_num_batched_tokens=chunk, token_buckets=tuple(sorted({T, chunk})),
              decoder_buckets=(chunk,), max_model_len=args.input_len + args.output_len + K + 2,
              enable_prefix_caching=False, progress=False, precompile=False)
    if args.spec:
        kw.update(spec_decode="dspark", num_draft_tokens=K, spec_varlen=False)
    kw.update(extra)
    llm = LLM(model, **kw)
    runner = llm.engine.runner
    # the bucket of a full decode step: C rows of K + 1 tokens
    variant = runner.buckets_of(types.SimpleNamespace(num_tokens=T, num_rows=C, num_decoder_tokens=T))
    text = compiled_text(llm, variant)
    res = census(text, args.top)
    trace = None
    if args.trace_steps:
        rng = np.random.default_rng(0)
        prompts = [rng.integers(4, cfg.vocab_size, size=args.input_len).tolist() for _ in range(C)]
        sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        events, seen, steps = traced_events(llm, prompts, sp, args.trace_steps)
        trace = join_trace(events, res["where"], steps)
        trace["variants"] = sorted({str(v) for v in seen})
        trace["census_variant"] = str(variant)

    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}, model {model}, "
          f"{'verification' if args.spec else 'decode'} step of {C} rows at bucket {variant}: "
          f"{res['kernels']} kernels from {res['functions']} functions")
    print("by op: " + ", ".join(f"{k} {v}" for k, v in res["by_op"].items()))
    timed = {r["function"]: r for r in (trace["by_function"] if trace else [])}
    print(f"\n{'kernels':>8} {'traced/step':>11} {'ms/step':>8}  function")
    for fn, n in res["by_function"].items():
        t = timed.get(fn)
        print(f"{n:8d} {t['kernels_per_step'] if t else float('nan'):11.1f} "
              f"{t['ms_per_step'] if t else float('nan'):8.3f}  {fn}")
    print(f"\n{'kernels':>8}  model part (the innermost frame under {', '.join(CALLER_ROOMS)})")
    for fn, n in res["by_caller"].items():
        print(f"{n:8d}  {fn}")
    if trace:
        print(f"\ntraced {trace['steps']} steps ({trace['events']} kernel events, "
              f"{100 * trace['matched_fraction']:.0f}% matched to the census; variants {trace['variants']})")
        if trace["unmatched"]:
            print(f"\n{'traced/step':>11} {'ms/step':>8}  unmatched kernel (hlo op)")
            for u in trace["unmatched"][:10]:
                print(f"{u['kernels_per_step']:11.1f} {u['ms_per_step']:8.3f}  {u['kernel'][:90]} ({u['hlo_op']})")
    out = args.out or os.path.join("benchmarks", "results", f"kernel_census_{jax.default_backend()}.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    res.pop("where")
    with open(out, "w") as f:
        json.dump({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "device": dev.device_kind, "platform": jax.default_backend(), "jax": jax.__version__,
                   "xla_flags": os.environ.get("XLA_FLAGS", ""), "model": model, "args": vars(args),
                   "variant": list(variant), "census": res, "trace": trace}, f, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
