#!/usr/bin/env python3
"""What the data/expert-parallel program costs on one device: ``DPModelRunner`` on a 1 x 1 mesh
against the plain ``ModelRunner``, same weights, same workload.

On one device the DP step is the plain step body inside a one-device ``shard_map`` (its
experts are all local, so the MoE op runs the same kernel; the inputs carry a leading rank
dimension of 1). Whatever it costs over the plain step is the price a single-GPU deployment
of the parallel program pays. Each runner serves the workload with async scheduling
(throughput) and with sync scheduling (the step's own time, dispatch to results), alternating
runners ``--repeats`` times; the table gives the best of each and the DP/plain ratio.

    python scripts/bench_dp_overhead.py                              # v41-tiny, this machine
    python scripts/bench_dp_overhead.py --model v41-small-code --num-prompts 64 --input-len 256 \\
        --output-len 64 --out benchmarks/results/dp_overhead_H200.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="v41-tiny")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engine", default="{}", help="JSON of EngineConfig fields")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/dp_overhead_<platform>.json)")
    args = ap.parse_args(argv)

    import jax
    import numpy as np

    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.engine.llm_engine import LLMEngine
    from deepinfer_jax.engine_config import EngineConfig
    from deepinfer_jax.models.registry import resolve_model
    from deepinfer_jax.runner.dp_runner import DPModelRunner
    from deepinfer_jax.runner.model_runner import ModelRunner
    from deepinfer_jax.sampling.params import SamplingParams
    from deepinfer_jax.sharding.mesh import ParallelConfig, make_mesh

    kw = dict(max_num_seqs=32, max_num_batched_tokens=256)
    kw.update(json.loads(args.engine))
    model_dir = resolve_model(args.model, progress=False)
    cfg = ModelConfig.from_json(model_dir)
    ec = EngineConfig.from_kwargs(**kw).resolve(cfg, jax.default_backend())
    t0 = time.perf_counter()
    runners = {"plain": ModelRunner(model_dir, ec, cfg=cfg, progress=False)}
    runners["dp_1x1"] = DPModelRunner(model_dir, ec, cfg=cfg, progress=False,
                                      mesh=make_mesh(ParallelConfig(), devices=jax.devices()[:1]))
    compile_s = {k: r.warmup(progress=False) for k, r in runners.items()}
    init_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, size=args.input_len).tolist() for _ in range(args.num_prompts)]
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    best: dict = {}
    tokens = {}
    for _ in range(args.repeats):
        for name, runner in runners.items():
            for mode in ("async", "sync"):
                eng = LLMEngine(runner, dataclasses.replace(ec, async_scheduling=mode == "async"),
                                eos_token_id=cfg.eos_token_id, vocab_size=cfg.vocab_size)
                eng.add_requests([(str(i), p, sp) for i, p in enumerate(prompts)])
                t = time.perf_counter()
                outs = eng.run_until_done()
                wall = time.perf_counter() - t
                s = eng.stats.summary()
                tokens.setdefault(name, sorted((o.request_id, tuple(o.outputs[0].token_ids)) for o in outs))
                decode = [x.step_time_s for x in eng.stats.steps if x.num_prefill_tokens == 0]
                st = eng.stats.steps
                rec = dict(wall_s=wall, gen_tok_s=s["generated_tokens"] / wall, steps=s["steps"],
                           decode_step_p50_ms=1e3 * float(np.median(decode)) if decode else None,
                           inputs_ms=1e3 * float(np.mean([x.inputs_s for x in st])),
                           call_ms=1e3 * float(np.mean([x.call_s for x in st])))
                key = (name, mode)
                prev = best.get(key)
                if prev is None or rec["wall_s"] < prev["wall_s"]:
                    best[key] = rec
    same = tokens["plain"] == tokens["dp_1x1"]
    rows = []
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}, model {model_dir}")
    print(f"workload: {args.num_prompts} prompts x {args.input_len} tokens, {args.output_len} output tokens, "
          f"max_num_seqs {ec.max_num_seqs}; best of {args.repeats}; same tokens: {same}")
    print(f"{'runner':8} {'mode':6} {'gen tok/s':>10} {'wall s':>8} {'decode step p50 ms':>19} {'vs plain':>9} "
          f"{'inputs ms':>10} {'call ms':>8}")
    for (name, mode), r in sorted(best.items(), key=lambda kv: (kv[0][1], kv[0][0] != "plain")):
        base = best[("plain", mode)]
        ratio = r["wall_s"] / base["wall_s"]
        rows.append(dict(runner=name, mode=mode, **r, wall_vs_plain=ratio))
        p50 = f"{r['decode_step_p50_ms']:.2f}" if r["decode_step_p50_ms"] is not None else "-"
        print(f"{name:8} {mode:6} {r['gen_tok_s']:10.1f} {r['wall_s']:8.3f} {p50:>19} {ratio:9.3f} "
              f"{r['inputs_ms']:10.2f} {r['call_ms']:8.2f}")
    out = args.out or os.path.join("benchmarks", "results", f"dp_overhead_{jax.default_backend()}.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "device": jax.devices()[0].device_kind, "platform": jax.default_backend(), "jax": jax.__version__,
                   "xla_flags": os.environ.get("XLA_FLAGS", ""), "model": model_dir, "args": vars(args),
                   "engine_config": dataclasses.asdict(ec), "init_s": init_s, "compile_s": compile_s,
                   "same_tokens": same, "table": rows}, f, indent=1, default=str)
    print(f"wrote {out}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
