#!/usr/bin/env python3
"""The cost of batch-invariant mode: ``LLM.generate`` throughput with ``batch_invariant`` off vs on.

One engine per mode on the same model and workload (compile included in the start-up column,
excluded from the timed runs): an untimed warm-up generate each, then ``--repeats`` timed
generates of the whole workload per mode, the modes alternating; the table gives each mode's
best run (generated and total tokens/s, median step time) and the ratio of on to off. It also checks the mode's promise on this workload: the
timed runs with the mode on must agree bit for bit (tokens and logprobs) with each other and
with a few of the requests run alone. Writes the table, configs and device to JSON.

    python scripts/bench_batch_invariance.py                 # v41-tiny random weights, this machine
    python scripts/bench_batch_invariance.py --model v41-small-code \\
        --out benchmarks/results/batch_invariance_H200.json  # the GPU run (kernels on: the default)

Defaults keep a run short (about 2 minutes on a 2-core CPU with v41-tiny; the GPU command above
is sized to finish in a few minutes on an H200, compiles included).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="v41-tiny")
    ap.add_argument("--num-prompts", type=int, default=None, help="default: 32 on CPU, 96 elsewhere")
    ap.add_argument("--input-len", type=int, default=None, help="mean prompt tokens (default 48 CPU, 256 GPU)")
    ap.add_argument("--output-len", type=int, default=None, help="default 16 CPU, 64 GPU")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--engine", default="{}", help="JSON of EngineConfig fields (both modes)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--check-alone", type=int, default=3, help="requests re-run alone to check the mode on")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/batch_invariance_<platform>.json)")
    args = ap.parse_args(argv)

    import jax
    import numpy as np

    from deepinfer_jax import LLM, SamplingParams

    cpu = jax.default_backend() == "cpu"
    n = args.num_prompts or (32 if cpu else 96)
    in_len = args.input_len or (48 if cpu else 256)
    out_len = args.output_len or (16 if cpu else 64)
    engine_kw = dict(max_num_seqs=16, max_num_batched_tokens=128) if cpu else \
        dict(max_num_seqs=32, max_num_batched_tokens=512, token_buckets=(64, 512), decoder_buckets=(512,))
    # no prefix cache: repeated runs of the same prompts would hit it, and a bounded replay (the
    # default) is an approximation that changes tokens; the check here is batch invariance only
    engine_kw["enable_prefix_caching"] = False
    engine_kw.update(json.loads(args.engine))

    rng = np.random.default_rng(args.seed)
    llms, init_s = {}, {}
    for on in (False, True):
        t0 = time.perf_counter()
        llms[on] = LLM(args.model, progress=False, batch_invariant=on, **engine_kw)
        init_s[on] = time.perf_counter() - t0
    configs = {on: llm.engine_config for on, llm in llms.items()}
    V = llms[False].model_config.vocab_size
    lens = rng.integers(max(1, in_len // 2), in_len * 3 // 2 + 1, n)
    prompts = [rng.integers(3, min(V, 30000), int(k)).tolist() for k in lens]
    params = [SamplingParams(temperature=args.temperature, max_tokens=out_len, ignore_eos=True,
                             seed=args.seed + i, logprobs=1) for i in range(n)]

    def run(llm):
        outs = llm.generate(prompts, params, use_tqdm=False)
        return llm.stats.summary(), [(o.outputs[0].token_ids, [d[t].logprob for d, t in
                                      zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]) for o in outs]

    for llm in llms.values():
        llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up (untimed)
    # the modes alternate run by run, so that a drift of the machine's load hits both alike
    best, runs, tps = {False: None, True: None}, {False: [], True: []}, {False: [], True: []}
    for _ in range(args.repeats):
        for on, llm in llms.items():
            s, res = run(llm)
            runs[on].append(res)
            tps[on].append(s["generated_tokens_per_s"])
            if best[on] is None or s["generated_tokens_per_s"] > best[on]["generated_tokens_per_s"]:
                best[on] = s
    llm = llms[True]
    k = min(args.check_alone, n)
    alone = [llm.generate([prompts[i]], [params[i]], use_tqdm=False)[0].outputs[0] for i in range(k)]
    check = dict(runs_identical=all(r == runs[True][0] for r in runs[True]),
                 alone_identical=all((a.token_ids, [d[t].logprob for d, t in zip(a.logprobs, a.token_ids)])
                                     == runs[True][0][i] for i, a in enumerate(alone)),
                 alone_checked=k)
    rows = []
    for on in (False, True):
        b = best[on]
        rows.append(dict(batch_invariant=on, init_and_compile_s=init_s[on], compile_s=llms[on].compile_time_s,
                         generated_tokens_per_s=b["generated_tokens_per_s"], total_tokens_per_s=b["total_tokens_per_s"],
                         step_time_p50_s=b["step_time_p50_s"], steps=b["steps"], wall_time_s=b["wall_time_s"],
                         all_runs_generated_tokens_per_s=tps[on], kernel_fallbacks=llms[on].runner.kernel_fallbacks(),
                         check=check if on else None))
    off, on = rows
    ratio = on["generated_tokens_per_s"] / off["generated_tokens_per_s"]
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), model {args.model}")
    print(f"workload: {n} prompts x ~{in_len} tokens, {out_len} output tokens, temperature {args.temperature}; "
          f"buckets {configs[True].token_buckets}, max_num_seqs {configs[True].max_num_seqs}, "
          f"kernels {configs[True].kernels or 'default'}")
    print(f"{'batch_invariant':16} {'gen tok/s':>10} {'tok/s':>9} {'vs off':>7} {'step p50 ms':>12} {'steps':>6} "
          f"{'start-up s':>11}")
    for r in rows:
        print(f"{str(r['batch_invariant']):16} {r['generated_tokens_per_s']:10.1f} {r['total_tokens_per_s']:9.1f} "
              f"{r['generated_tokens_per_s'] / off['generated_tokens_per_s']:7.2f} {1e3 * r['step_time_p50_s']:12.2f} "
              f"{r['steps']:6d} {r['init_and_compile_s']:11.1f}")
    print("generated tok/s of every run: " + "; ".join(f"{'on' if on else 'off'} " + ", ".join(f"{x:.0f}" for x in tps[on])
                                                       for on in (False, True)))
    print(f"mode on: timed runs identical: {on['check']['runs_identical']}; "
          f"{on['check']['alone_checked']} requests alone identical to the batch: {on['check']['alone_identical']}")
    out = args.out or os.path.join("benchmarks", "results", f"batch_invariance_{jax.default_backend()}.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump({
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": jax.devices()[0].device_kind, "platform": jax.default_backend(), "jax": jax.__version__,
            "model": args.model, "args": vars(args), "workload": dict(num_prompts=n, input_len=in_len, output_len=out_len),
            "engine_kwargs": engine_kw, "throughput_ratio_on_vs_off": ratio, "table": rows,
            "mean_prompt_tokens": statistics.mean(len(p) for p in prompts),
            "load_average_at_end": os.getloadavg() if hasattr(os, "getloadavg") else None,
        }, f, indent=1, default=str)
    print(f"wrote {out}")
    ok = on["check"]["runs_identical"] and on["check"]["alone_identical"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
