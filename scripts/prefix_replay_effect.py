#!/usr/bin/env python3
"""Effect of the bounded prefix replay on outputs, against no prefix caching and the exact replay.

A prefix-cache hit restores the compressed caches but not the sliding-window state; the engine
rebuilds it by replaying the tail of the cached prefix (``EngineConfig.prefix_replay``). "exact"
replays (n_layers-1)*(W-1)+W tokens (43 for v41-tiny) and must equal no caching; "bounded"
replays ``prefix_replay_tokens`` (rounded up to a block), DeepSeek's approximation. On one
runner (v41-tiny, random weights, CPU) the script runs a shared-prefix workload greedily with
caching off, exact, and bounded at several tails, and prints per mode:

* the tokens replayed per hit (the tail rounded up to a block),
* tokens that differ from the no-cache run (and requests with any difference),
* max |logprob diff| over the top-k logprobs at positions whose context still equals the
  no-cache run's (up to and including the first differing token),
* prompt tokens computed (prompt length minus ``num_cached_tokens``) and the share of no-cache.

YOCO truncation is off so the replay is the only approximation. Writes JSON to
benchmarks/results/prefix_replay_effect_<platform>.json.

    python scripts/prefix_replay_effect.py [--tails 0,8,16,24,32,40] [--num-prompts 16]
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


def workload(n: int, shared: int, lo: int, hi: int, vocab: int, seed: int):
    import numpy as np

    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, vocab, size=shared).tolist()
    return [prefix + rng.integers(3, vocab, size=int(rng.integers(lo, hi + 1))).tolist() for _ in range(n)]


def compare(ref, outs) -> dict:
    """Differences of ``outs`` from the no-cache ``ref`` (greedy, with top-k logprobs)."""
    diff_tokens = diff_requests = 0
    max_lp = 0.0
    for a, b in zip(ref, outs):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        d = [i for i, (x, y) in enumerate(zip(ta, tb)) if x != y]
        diff_tokens += len(d)
        diff_requests += bool(d)
        last = d[0] if d else len(ta) - 1  # positions with the same context as the reference
        for da, db in zip(a.outputs[0].logprobs[:last + 1], b.outputs[0].logprobs[:last + 1]):
            for t in set(da) & set(db):
                max_lp = max(max_lp, abs(da[t].logprob - db[t].logprob))
    return {"differing_tokens": diff_tokens, "differing_requests": diff_requests, "max_abs_logprob_diff": max_lp}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tails", default="0,8,16,24,32,40", help="bounded prefix_replay_tokens to measure")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--shared-prefix", type=int, default=320)
    ap.add_argument("--suffix", default="8,48", help="unique suffix length range lo,hi")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import jax

    from deepinfer_jax import LLM, SamplingParams
    from deepinfer_jax.engine.llm_engine import LLMEngine
    from deepinfer_jax.engine_config import exact_replay_tokens

    engine_kw = dict(max_num_seqs=8, max_num_batched_tokens=128, token_buckets=(128,), block_tokens=8,
                     max_model_len=512, yoco_truncation="off", max_logprobs=5)
    t0 = time.perf_counter()
    llm = LLM("v41-tiny", progress=False, **engine_kw)
    init_s = time.perf_counter() - t0
    cfg, base = llm.model_config, llm.engine_config
    lo, hi = (int(x) for x in args.suffix.split(","))
    prompts = workload(args.num_prompts, args.shared_prefix, lo, hi, cfg.vocab_size, args.seed)
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, logprobs=5)

    modes = [("off", dict(enable_prefix_caching=False)), ("exact", dict(prefix_replay="exact", prefix_replay_tokens=None))]
    modes += [(f"bounded {t}", dict(prefix_replay="bounded", prefix_replay_tokens=int(t))) for t in args.tails.split(",")]
    rows, ref = [], None
    for name, kw in modes:
        ec = dataclasses.replace(base, **kw).resolve(cfg, jax.default_backend())
        # a fresh scheduler (empty prefix cache) on the same runner: same compiled steps
        llm.engine = LLMEngine(llm.runner, ec, llm.tokenizer, cfg.eos_token_id)
        t1 = time.perf_counter()
        outs = llm.generate(prompts[:1], sp, use_tqdm=False)  # fills the cache
        outs += llm.generate(prompts[1:], sp, use_tqdm=False)  # hits it
        wall = time.perf_counter() - t1
        computed = sum(len(o.prompt_token_ids) - o.num_cached_tokens for o in outs)
        # the hits: every later prompt's full blocks of the shared prefix (suffixes are random)
        hits = [min(args.shared_prefix, len(o.prompt_token_ids) - 1) // ec.block_tokens * ec.block_tokens
                for o in outs[1:]] if ec.enable_prefix_caching else []
        replayed = [h - o.num_cached_tokens for h, o in zip(hits, outs[1:])]
        ref = ref or outs
        row = {"mode": name, "prefix_replay": ec.prefix_replay if ec.enable_prefix_caching else None,
               "prefix_replay_tokens": ec.prefix_replay_tokens if ec.enable_prefix_caching else None,
               "replayed_per_hit": max(replayed, default=None), **compare(ref, outs),
               "prompt_tokens_computed": computed,
               "num_cached_tokens": sum(o.num_cached_tokens for o in outs), "wall_s": wall}
        rows.append(row)
    n_prompt = sum(map(len, prompts))
    for r in rows:
        r["computed_share"] = r["prompt_tokens_computed"] / n_prompt

    n_out = args.num_prompts * args.output_len
    print(f"v41-tiny (random weights, {jax.devices()[0].device_kind}), W={cfg.sliding_window}, "
          f"{cfg.num_hidden_layers} layers, exact replay {exact_replay_tokens(cfg)} tokens, blocks of "
          f"{base.block_tokens}; {args.num_prompts} prompts = {args.shared_prefix} shared + {lo}..{hi} own tokens, "
          f"{args.output_len} greedy tokens each ({n_out} in all); init {init_s:.1f}s")
    print(f"{'mode':11} {'tail':>5} {'replayed':>9} {'diff tok':>9} {'diff req':>9} {'max |dlogprob|':>15} "
          f"{'prompt tok computed':>20} {'share':>6}")
    for r in rows:
        tail = "-" if r["prefix_replay_tokens"] is None else r["prefix_replay_tokens"]
        rep = "-" if r["replayed_per_hit"] is None else r["replayed_per_hit"]
        print(f"{r['mode']:11} {tail:>5} {rep:>9} {r['differing_tokens']:9d} {r['differing_requests']:9d} "
              f"{r['max_abs_logprob_diff']:15.2e} {r['prompt_tokens_computed']:20d} {r['computed_share']:6.1%}")
    out = args.out or os.path.join("benchmarks", "results", f"prefix_replay_effect_{jax.default_backend()}.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump({
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": jax.devices()[0].device_kind, "platform": jax.default_backend(), "jax": jax.__version__,
            "model": "v41-tiny (random weights, model_seed 0)", "args": vars(args),
            "engine_config": {k: v for k, v in dataclasses.asdict(base).items()
                              if k not in ("prefix_replay", "prefix_replay_tokens", "enable_prefix_caching")},
            "exact_replay_tokens": exact_replay_tokens(cfg), "prompt_tokens": n_prompt,
            "output_tokens": n_out, "table": rows,
        }, f, indent=1, default=str)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
