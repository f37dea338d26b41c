#!/usr/bin/env python3
"""Which part of the step breaks batch invariance on this device: the GPU evidence of
``tests/test_batch_invariance.py::test_device_batch_invariance`` as a report, not an assertion.

Runs the device test's workload (41 prompts, the shipped model, T=32 / T=128 buckets, 8 / 48
rows) with ``batch_invariant=True``, then a few picked requests alone, and reports per request
whether tokens / logprobs / top logprobs are identical and the largest logprob difference.
``--kernels reference`` separates the Pallas kernels from XLA's own ops; run it under different
``XLA_FLAGS`` (e.g. ``--xla_gpu_autotune_level=0``) to test the autotuner. One JSON line on stdout.

    python scripts/batch_invariance_probe.py --kernels auto
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", default="auto")
    ap.add_argument("--mode", choices=("on", "off"), default="on")
    ap.add_argument("--picks", type=int, nargs="+", default=[0, 17, 40])
    args = ap.parse_args(argv)
    import numpy as np

    from deepinfer_jax import LLM, SamplingParams
    from deepinfer_jax.models.registry import DEFAULT_MODEL

    engine = dict(max_num_seqs=48, max_num_batched_tokens=128, token_buckets=(32, 128), row_buckets=(8, 48),
                  decoder_buckets=(128,), progress=False, precompile=False)
    llm = LLM(DEFAULT_MODEL, batch_invariant=args.mode == "on", kernels=args.kernels, **engine)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, min(llm.model_config.vocab_size, 4000), int(k)).tolist()
               for k in rng.integers(5, 120, 41)]
    kinds = [dict(temperature=0.0), dict(temperature=0.8), dict(temperature=1.0, top_k=20),
             dict(temperature=0.7, top_p=0.9), dict(temperature=1.2, min_p=0.05)]
    params = [SamplingParams(max_tokens=12, seed=1000 + i, logprobs=3, ignore_eos=True, **kinds[i % 5])
              for i in range(len(prompts))]

    def run(ps, sps):
        outs = llm.generate(ps, sps, use_tqdm=False)
        res = []
        for o in outs:
            c = o.outputs[0]
            res.append(dict(tokens=list(c.token_ids),
                            logprob=[float(d[t].logprob) for d, t in zip(c.logprobs, c.token_ids)]))
        return res

    batch = run(prompts, params)
    report = dict(kernels=args.kernels, mode=args.mode, xla_flags=os.environ.get("XLA_FLAGS", ""),
                  fallbacks=llm.runner.kernel_fallbacks(), requests=[])
    for i in args.picks:
        a = run([prompts[i]], [params[i]])[0]
        b = batch[i]
        same_tok = a["tokens"] == b["tokens"]
        n = min(len(a["logprob"]), len(b["logprob"]))
        d = np.abs(np.asarray(a["logprob"][:n]) - np.asarray(b["logprob"][:n]))
        first = int(np.argmax(d > 0)) if (d > 0).any() else -1
        report["requests"].append(dict(request=i, prompt_len=len(prompts[i]), same_tokens=same_tok,
                                       logprob_equal=bool((d == 0).all()), max_abs_dlogprob=float(d.max()),
                                       first_diff_position=first))
    again = run(prompts, params)
    report["second_run_identical"] = again == batch
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
