#!/usr/bin/env python3
"""DSpark speculative decoding throughput: no speculation vs fixed-length vs varlen verification.

For each concurrency C (requests running at once, ``max_num_seqs``) and each mode, builds an
engine, runs an untimed warm-up (a few prompts, then one whole wave), then runs a wave of
``--requests-per-slot`` x C prompts ``--repeats`` times (the row is the median wave, each wave's
figures kept in the JSON) and records generated tokens per second, steps, the mean accepted length
(tokens per verification row) and the step time. Prints a table with each mode's ratio to no
speculation and varlen's ratio to the fastest fixed length, measured in the same run; writes
JSON. Modes: ``none``, ``varlen``, ``fixed`` (K drafts a row) and ``fixed1`` .. ``fixedK`` (L
drafts a row on the same engine: ``Scheduler.draft_limit``), e.g.
``--modes none,fixed1,fixed2,fixed3,fixed4,fixed,varlen`` for the issue's "best fixed length".

The headline tokens/s is the full-batch window's (``full_batch_generated_tokens_per_s``: from the
first to the last step that ran C rows, the serving steady state while requests wait in the queue);
``wave tok/s`` is the whole wave's. They differ most with speculation: requests then run at their
own pace (their acceptance differs), so a wave ends with a tail of the slowest few requests in
steps of a few rows, where a wave without speculation ends all together. With one request per slot
(``--requests-per-slot 1``) that tail is most of the wave and hides the speed-up.

    python scripts/bench_spec.py                                  # shipped model, this machine
    python scripts/bench_spec.py --concurrency 16 60 96 256 --input-len 256 --output-len 128 \\
        --out benchmarks/results/spec_H200.json
    python scripts/bench_spec.py --model v41-tiny --force-accept 0.75    # random weights, forced acceptance
    python scripts/bench_spec.py --slice tiny --concurrency 16 60 96 256 --modes none,fixed,varlen \\
        --out benchmarks/results/spec_slice_H200.json           # on the GPU: a per-GPU V4.1-Flash slice

``--slice tiny|full`` runs a per-GPU slice of V4.1-Flash with random weights drawn on the device
(``EngineConfig.load_format="dummy"``; seconds, where a multi-GB random checkpoint takes
minutes through the host): Flash's widths (``--small``: the tiny model's, a CPU smoke run), the
tiny model's 6 + 2 layers or the released 40 + 3, ``--experts`` local routed experts (default 8;
7 with ``full``: DeepInfer's EP64 decode rank), as ``scripts/bench_e2e.py``
(``models/model_slice.py``). Its config and tokenizer are written to a temporary directory; the
prompts are random token ids; ``--force-accept`` defaults to 0.75 (DeepSeek's decode-throughput
convention: tau = 1 + n*0.75 in expectation). The JSON's ``slice`` records the widths, layers,
experts and forced acceptance.

Prompts are cut from Python sources (``--prompts-from DIR``, default this project's own package,
which the shipped model never saw). ``--force-accept A`` accepts each draft with probability A
whatever the target says (``EngineConfig.spec_force_accept``: the engine at a chosen acceptance,
tau = 1 + n*A in expectation; the tokens are not the model's), for random-weight models.
Token buckets per engine: C, 2C, ..., (K+1)C and the prefill chunk size, so no-speculation
decode steps are not padded to verification sizes. Fixed length and varlen share one engine (the
same jitted step; the fixed rows are Algorithm 1 switched off in its scheduler), so a concurrency
compiles two engines, not three; ``init_and_compile_s`` is 0 for the mode that reuses it. That
engine also compiles plain steps (``spec_plain_steps``, on with varlen), which only varlen runs:
the table's ``plain steps`` column counts them. ``--engine '{"spec_plain_steps": false}'``
measures varlen without them. ``--trace-steps N`` adds each mode's kernel breakdown over N traced
decode steps of C requests (``decode_trace``: kernels per step, busy and idle device time, time
per kernel family, the busiest kernels). Each row also keeps the measured decode-step times per
bucket and step kind (``decode_step_ms``) and varlen's step-time curves, start-up profile and
learned (``step_time_model_ms``): where varlen plans shorter rows than pay, they show whether its
cost model or its acceptance estimates are off.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_offline, step_profile

MODES = ("none", "fixed", "varlen")  # and fixed1 .. fixedK: the fixed length L on the same engine


def mode_error(mode: str, K: int | None = None) -> str | None:
    """Why ``mode`` is not a mode (None if it is): none, varlen, fixed (K drafts a row) or
    fixedL with 1 <= L <= K."""
    m = re.fullmatch(r"fixed([0-9]+)", mode)
    if mode in MODES or (m and int(m.group(1)) >= 1 and (K is None or int(m.group(1)) <= K)):
        return None
    return f"{mode!r} is not one of none, fixed, fixed1..fixed{K or 'K'}, varlen"


def fixed_length(mode: str, K: int) -> int | None:
    """Drafts per row of a fixed-length mode (``fixed``: K), None for the others."""
    if mode == "fixed":
        return K
    return int(mode[5:]) if mode.startswith("fixed") else None


def source_prompts(tokenizer, root: str, n: int, length: int, seed: int) -> list[list[int]]:
    import numpy as np

    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".py"))
    ids = []
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            ids += tokenizer.encode(fh.read())
        if len(ids) > 4 * n * length:
            break
    if len(ids) < length + 1:
        raise SystemExit(f"--prompts-from {root}: {len(ids)} tokens of Python, need more than {length}")
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(ids) - length, size=n)
    return [ids[s:s + length] for s in starts]


def write_slice(args) -> tuple[str, object, dict]:
    """``--slice``: the slice's ``config.json`` and tokenizer in a temporary directory (the engines
    draw its weights on the device); returns (directory, config, the JSON's ``slice`` record)."""
    import tempfile

    from deepinfer_jax.checkpoint.random_checkpoint import write_random_model_config
    from deepinfer_jax.models.model_slice import slice_config

    experts = args.experts or (7 if args.slice == "full" else 8)
    longest = args.input_len + args.output_len + 2  # + the drafts (the model's block at most)
    draft = slice_config(args.small, experts, longest, args.slice)
    n_draft = args.num_draft_tokens or draft.dspark_block_size
    model_dir = tempfile.mkdtemp(prefix=f"v41_slice_{args.slice}_")
    cfg = write_random_model_config(slice_config(args.small, experts, longest + n_draft, args.slice), model_dir)
    widths = "tiny" if args.small else "flash"
    info = dict(name=f"v41-flash-slice-{args.slice}" + ("-small" if args.small else ""), depth=args.slice, widths=widths,
                hidden_size=cfg.hidden_size, layers=cfg.num_hidden_layers, nextn_layers=cfg.num_nextn_predict_layers,
                experts=cfg.n_routed_experts, experts_per_token=cfg.num_experts_per_tok,
                force_accept=args.force_accept, load_format="dummy", dir=model_dir)
    print(f"slice {info['name']}: {info['layers']} + {info['nextn_layers']} layers, D={cfg.hidden_size}, "
          f"{cfg.n_routed_experts} local experts, weights drawn on the device; config in {model_dir}", flush=True)
    return model_dir, cfg, info


def random_prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(4, vocab, size=length).tolist() for _ in range(n)]


def hottest(prof, n: int, steps: int) -> list[dict]:
    """The ``n`` functions of most own time: where, calls and own / cumulative ms per step."""
    import pstats

    st = pstats.Stats(prof)
    rows = []
    for (file, line, fn), (_cc, nc, tt, ct, _callers) in st.stats.items():
        rows.append(dict(function=f"{os.path.basename(file)}:{line}:{fn}", calls_per_step=nc / max(steps, 1),
                         own_ms_per_step=1e3 * tt / max(steps, 1), cum_ms_per_step=1e3 * ct / max(steps, 1)))
    return sorted(rows, key=lambda r: -r["own_ms_per_step"])[:n]


def decode_step_ms(llm) -> dict:
    """Measured decode-only steps (no prompt tokens) of the last wave: median ms and count per
    padded bucket and step kind (``verify``: the spec step with verification slots, ``plain``:
    without, ``none``: an engine without speculation)."""
    import statistics

    spec = getattr(llm.engine.scheduler, "num_draft_tokens", 0) > 0
    groups: dict[str, list[float]] = {}
    for st in llm.stats.steps:
        if st.num_prefill_tokens:
            continue
        kind = ("plain" if st.spec_plain else "verify") if spec else "none"
        groups.setdefault(f"{kind} {st.bucket_tokens}", []).append(st.step_time_s)
    return {k: {"p50_ms": 1e3 * statistics.median(v), "steps": len(v)} for k, v in sorted(groups.items())}


def step_time_model_ms(llm) -> dict:
    """Varlen's step-time curves after the run (what its plan used) next to their start-up
    profile, per profiled bucket: ``{kind: {bucket: [start-up ms, learned ms]}}``; empty without
    varlen's estimators."""
    out = {}
    for kind, est in (("verify", llm.engine.forward_estimator), ("plain", llm.engine.plain_estimator)):
        if est is not None:
            out[kind] = {int(b): [1e3 * est.base(b), 1e3 * est.seconds(b)] for b in est.tokens}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model dir or name (default: the shipped model)")
    ap.add_argument("--slice", choices=("tiny", "full"), default=None,
                    help="instead of --model: a per-GPU V4.1-Flash slice with random weights drawn on the "
                         "device, the tiny model's 6 + 2 layers or the released 40 + 3")
    ap.add_argument("--small", action="store_true", help="with --slice: the tiny model's widths (CPU smoke run)")
    ap.add_argument("--experts", type=int, default=None,
                    help="with --slice: local routed experts per layer (default 8; with --slice full 7)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--num-draft-tokens", type=int, default=None, help="default: the model's DSpark block")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--prefill-chunk", type=int, default=512, help="the largest token bucket at least")
    ap.add_argument("--force-accept", type=float, default=None,
                    help="accept each draft with this probability (default: off; with --slice 0.75)")
    ap.add_argument("--prompts-from", default=None, help="directory of .py files (default: deepinfer_jax/)")
    ap.add_argument("--engine", default="{}", help="JSON of further EngineConfig fields")
    ap.add_argument("--bucket-multiples", type=int, nargs="+", default=None,
                    help="token buckets as multiples of C (default 1 .. K+1; fewer = fewer compiles)")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="run each timed generate under cProfile and keep its N hottest functions "
                         "(own time per step) in the JSON row (host time is inflated by the profiler)")
    ap.add_argument("--requests-per-slot", type=int, default=4, metavar="R",
                    help="a wave is R x C prompts with C running at once (default 4)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed waves per mode after the warm-up; the row is the median wave (default 3)")
    ap.add_argument("--trace-steps", type=int, default=0, metavar="N",
                    help="after each mode's waves, trace N decode steps of C requests with jax.profiler and "
                         "keep the kernel breakdown (scripts/step_profile.py) in the row as decode_trace")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    for m in modes:
        if mode_error(m):
            ap.error(f"--modes: {mode_error(m)}")
    if any(c < 1 for c in args.concurrency):
        ap.error("--concurrency: values must be >= 1")
    if args.requests_per_slot < 1:
        ap.error(f"--requests-per-slot: {args.requests_per_slot} must be >= 1")
    if args.repeats < 1:
        ap.error(f"--repeats: {args.repeats} must be >= 1")
    if args.slice is None and (args.small or args.experts is not None):
        ap.error("--small and --experts shape a --slice: give --slice tiny or --slice full")
    if args.slice is not None:
        if args.model is not None:
            ap.error("--model and --slice: give one (--slice draws its own random model)")
        if args.experts is not None and args.experts < 1:
            ap.error(f"--experts: {args.experts} must be >= 1")
        if args.force_accept is None:
            args.force_accept = 0.75

    import jax

    from deepinfer_jax import LLM, SamplingParams
    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.models.registry import DEFAULT_MODEL, resolve_model
    from deepinfer_jax.tokenizer.loader import load_tokenizer

    load = {}
    slice_info = None
    if args.slice is not None:
        model, cfg, slice_info = write_slice(args)
        model_dir = model
        load = dict(load_format="dummy")
    else:
        model = args.model or DEFAULT_MODEL
        model_dir = resolve_model(model, progress=False)
        cfg = ModelConfig.from_json(model_dir)
    label = slice_info["name"] if slice_info else model  # the model as the table and the JSON name it
    K = args.num_draft_tokens or cfg.dspark_block_size
    for m in modes:
        if mode_error(m, K):
            ap.error(f"--modes: {mode_error(m, K)} (K = {K})")
    tok = None
    if slice_info is None and os.path.exists(os.path.join(model_dir, "tokenizer.json")):
        tok = load_tokenizer(model_dir, bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id)
    root = args.prompts_from or os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "deepinfer_jax")
    sp = SamplingParams(temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True, seed=args.seed)
    extra = json.loads(args.engine)

    rows = []

    def report(final: bool):
        def find(C, m):
            return next((r for r in rows if r["concurrency"] == C and r["mode"] == m), None)

        def best_fixed(C):  # the fastest fixed length measured at C
            fx = [r for r in rows if r["concurrency"] == C and fixed_length(r["mode"], K)]
            return max(fx, key=lambda r: r["full_batch_generated_tokens_per_s"], default=None)

        say = print if final else (lambda *a, **k: None)
        say(f"\ndevice: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
              f"model {label}, {args.input_len} prompt + {args.output_len} generated tokens, K={K}, "
              f"temperature {args.temperature}" + (f", FORCED acceptance {args.force_accept}" if args.force_accept else ""))
        say(f"{'C':>5} {'mode':7} {'gen tok/s':>10} {'vs none':>8} {'wave tok/s':>10} {'tau':>5} {'steps':>6} "
              f"{'step p50 ms':>12} {'drafts/row':>10} {'plain steps':>11} {'varlen/best fixed':>17}")
        for r in rows:
            none, fixed = find(r["concurrency"], "none"), best_fixed(r["concurrency"])
            key = "full_batch_generated_tokens_per_s"
            vs = r[key] / none[key] if none and none[key] else float("nan")
            vf = r[key] / fixed[key] if fixed and fixed[key] and r["mode"] == "varlen" else float("nan")
            per_row = r["drafts_verified"] / r["spec_rows"] if r["spec_rows"] else 0.0
            # varlen against the fastest fixed length measured at this concurrency
            r.update(vs_none=vs, varlen_vs_fixed=vf, drafts_per_row=per_row,
                     best_fixed_mode=fixed["mode"] if fixed and r["mode"] == "varlen" else None)
            say(f"{r['concurrency']:5d} {r['mode']:7} {r[key]:10.1f} {vs:8.2f} {r['generated_tokens_per_s']:10.1f} "
                  f"{r['mean_accepted_length'] or 1.0:5.2f} {r['steps']:6d} {1e3 * r['step_time_p50_s']:12.2f} "
                  f"{per_row:10.2f} {r.get('spec_plain_steps', 0):11d} {vf:17.3f}")
        out = args.out or os.path.join("benchmarks", "results", f"spec_{jax.default_backend()}.json")
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:
            json.dump({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "device": jax.devices()[0].device_kind, "platform": jax.default_backend(),
                       "jax": jax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", ""),
                       "model": label, "slice": slice_info,
                       "force_accept": args.force_accept, "args": vars(args), "num_draft_tokens": K,
                       "rows": rows}, f, indent=1, default=str)
        if final:
            print(f"wrote {out}")

    for C in args.concurrency:
        n_prompts = C * args.requests_per_slot
        if tok is not None:
            prompts = source_prompts(tok, root, n_prompts + 4, args.input_len, args.seed + C)
        else:
            prompts = random_prompts(cfg.vocab_size, n_prompts + 4, args.input_len, args.seed + C)
        warm, timed = prompts[:4], prompts[4:]
        chunk = max(args.prefill_chunk, (K + 1) * C)
        mults = args.bucket_multiples or range(1, K + 2)
        buckets = tuple(sorted({C * j for j in mults} | {(K + 1) * C, chunk}))
        max_len = args.input_len + args.output_len + K + 2
        # one decoder bucket (the largest token bucket): one compiled variant per token bucket
        # (YOCO's compact prefill would add a variant per smaller bucket; on the GPU each
        # variant of the spec step compiles for tens of seconds)
        base_kw = dict(max_num_seqs=C, max_num_batched_tokens=chunk, token_buckets=buckets,
                       decoder_buckets=(max(buckets),),
                       max_model_len=max_len, enable_prefix_caching=False, progress=False, **load)
        base_kw.update(extra)  # --engine overrides the defaults above
        spec_llm = None
        for mode in modes:
            kw = dict(base_kw)
            t0 = time.perf_counter()
            if mode == "none":
                llm = LLM(model, **kw)
            elif spec_llm is None:
                kw.update(spec_decode="dspark", num_draft_tokens=K, spec_varlen=True,
                          spec_force_accept=args.force_accept)
                llm = spec_llm = LLM(model, **kw)
            else:
                llm = spec_llm  # fixed and varlen run the same jitted step: one compile serves both
            if mode != "none":
                sch = llm.engine.scheduler
                sch.spec_varlen = mode == "varlen"  # off: every row the fixed length
                sch.draft_limit = fixed_length(mode, K)  # fixedL: L drafts a row on the engine of K
            init_s = time.perf_counter() - t0
            # warm-up: a short wave, then one whole wave (every step size of the timed waves has run
            # once, and varlen's step-time curves have seen them)
            llm.generate(warm, sp, use_tqdm=False)
            llm.generate(timed, sp, use_tqdm=False)
            waves = []
            for rep in range(args.repeats):
                llm.stats.reset()
                prof = None
                if args.cprofile and rep == 0:
                    import cProfile

                    prof = cProfile.Profile()
                    prof.enable()
                outs = llm.generate(timed, sp, use_tqdm=False)
                if prof is not None:
                    prof.disable()
                s = llm.stats.summary()
                s["decode_step_ms"] = decode_step_ms(llm)
                if prof is not None:
                    s["cprofile_hottest"] = hottest(prof, args.cprofile, s["steps"])
                waves.append((s, sum(len(o.outputs[0].token_ids) for o in outs)))
            # the row is the median wave by full-batch tokens/s (every wave's figures are kept)
            key = "full_batch_generated_tokens_per_s"
            tps = [w[0][key] for w in waves]
            s, n_out = sorted(waves, key=lambda w: w[0][key])[(len(waves) - 1) // 2]
            if args.trace_steps:
                from bench_offline import traced_decode_idle

                llm.stats.reset()
                s = dict(s, decode_trace=traced_decode_idle(llm.engine, timed[:C], sp, args.trace_steps))
            rows.append(dict(concurrency=C, mode=mode, requests_per_slot=args.requests_per_slot,
                             init_and_compile_s=init_s, output_tokens=n_out, waves_full_batch_tokens_per_s=tps,
                             waves_generated_tokens_per_s=[w[0]["generated_tokens_per_s"] for w in waves],
                             step_time_model_ms=step_time_model_ms(llm), **s))
            spread = f" (waves {min(tps):.1f}-{max(tps):.1f})" if len(tps) > 1 else ""
            print(f"C={C:4d} {mode:7s} {s[key]:9.1f} gen tok/s full batch{spread}, "
                  f"{s['generated_tokens_per_s']:.1f} whole wave, {s['steps']} steps, "
                  f"tau {s['mean_accepted_length'] or 1.0:.2f}, {s['spec_plain_steps']} plain steps", flush=True)
            report(final=False)  # the JSON so far, in case a time limit stops the run

    report(final=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
