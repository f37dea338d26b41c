#!/usr/bin/env python3
"""The engine's own host work per step, without a device: plan, build inputs, apply results.

Drives the real ``LLMEngine`` (scheduler, ``build_step_input`` + packing, result processing with
detokenization and stop checks) with a runner whose jitted call is replaced by synthetic
outputs (random token ids, put on the device at once), so each step's host phases are measured alone:
no device time, no XLA thread competing for the cores, no kernel launches. What the jitted call
itself costs depends on the device (``bench_offline.py`` measures it there, and
``EngineConfig.dispatch_thread`` moves it off the engine's thread).

For each row count R: R prompts of ``--input-len`` tokens (the shipped model's tokenizer and
Engram hashing by default), ``--output-len`` greedy tokens each, ``max_num_seqs = R``, one token
bucket for the prefill (every prompt in the first step) and one of R tokens for the decode
steps; the table gives per-phase medians over the decode steps (every row one token), their
total (plan + inputs + results: the "call" column only puts the synthetic outputs on the
device), and the prefill step's total for reference.

    python scripts/bench_host_path.py                      # R = 64 128 256 512, sync and async
    python scripts/bench_host_path.py --rows 256 --modes async --out /tmp/host.json

Writes JSON (default ``benchmarks/results/host_path_<machine>.json``) with the CPU model.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

PHASES = ("schedule", "inputs", "call", "process")
OWN = ("schedule", "inputs", "process")  # the engine's own work; "call" here only moves the synthetic outputs


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_only_runner(model_dir: str, ec, cfg, seed: int, accept: float = 0.6):
    """A ``ModelRunner`` without weights or cache whose step call returns random tokens; with
    speculation (``ec.spec_decode``), each draft passes with probability ``accept`` until the
    first rejection, and the next drafts and their confidence logits are random. Varlen planning
    reads a modelled step-time curve, 5 ms + 2 us a token (``bucket_seconds``)."""
    import jax
    import numpy as np

    from deepinfer_jax.runner.model_runner import ModelRunner
    from deepinfer_jax.runner.spec_step import SpecStepOutput
    from deepinfer_jax.sampling.sampler import SamplerOutput

    class HostOnlyRunner(ModelRunner):
        def __init__(self):
            self._init_host(model_dir, ec, cfg, None)  # the host state only: no weights, no cache
            self.kernels = "reference"
            if self.spec_slots:  # varlen's start-up curve (the real runner profiles its buckets)
                self.bucket_seconds = {T: 5e-3 + 2e-6 * T for T in ec.token_buckets}
            self.rng = np.random.default_rng(seed)
            self._sched = None

        def step_inputs(self, sched, T, R, Td):
            self._sched = sched  # the fake step reads the rows' draft counts
            return super().step_inputs(sched, T, R, Td)

        def step_call(self, bufs, layout, prompt_lp):
            sched = self._sched

            def step():  # the jitted step's outputs: (cache, sampler outputs, prompt logprobs, carry)
                R, N, K, rng = self.num_rows, ec.max_logprobs, self.spec_slots, self.rng
                if not K:
                    out = SamplerOutput(rng.integers(4, cfg.vocab_size, R).astype(np.int32),
                                        -rng.random(R, dtype=np.float32), np.zeros((R, N), np.int32),
                                        np.zeros((R, N), np.float32))
                    return None, jax.device_put(out), None, None
                rows = sched.rows  # (decode columns of a plain step: built as rows here)
                nd = np.zeros(R, np.int64)
                nd[:len(rows)] = [r.num_drafts for r in rows]
                passed = rng.random((R, K)) < accept
                first_fail = np.where(passed.all(1), K, np.argmin(passed, 1))
                out = SpecStepOutput(np.minimum(first_fail, nd).astype(np.int32),
                                     rng.integers(4, cfg.vocab_size, (R, K + 1)).astype(np.int32),
                                     -rng.random((R, K + 1), dtype=np.float32), np.zeros((R, K + 1, N), np.int32),
                                     np.zeros((R, K + 1, N), np.float32),
                                     rng.integers(4, cfg.vocab_size, (R, K)).astype(np.int32),
                                     rng.normal(size=(R, K)).astype(np.float32))
                return None, jax.device_put(out), None, None

            return step, (), {}

    return HostOnlyRunner()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model dir or name (default: the shipped model)")
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256, 512])
    ap.add_argument("--input-len", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--modes", default="sync,async")
    ap.add_argument("--spec", default="none", help="comma-separated: none, fixed, varlen (DSpark rows; "
                    "random acceptance --accept per draft), plain (a speculative engine held in plain steps: "
                    "its host path where varlen stops verifying)")
    ap.add_argument("--accept", type=float, default=0.6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    for name in ("rows", "input_len", "output_len"):
        vals = getattr(args, name)
        if any(v < 1 for v in (vals if isinstance(vals, list) else [vals])):
            ap.error(f"--{name.replace('_', '-')}: must be >= 1, got {vals}")
    modes = args.modes.split(",")
    if any(m not in ("sync", "async") for m in modes):
        ap.error(f"--modes: {args.modes!r}: expected sync and/or async")
    specs = args.spec.split(",")
    if any(m not in ("none", "fixed", "varlen", "plain") for m in specs):
        ap.error(f"--spec: {args.spec!r}: expected none, fixed, varlen and/or plain")
    if not 0.0 <= args.accept <= 1.0:
        ap.error(f"--accept: {args.accept}: must be in [0, 1]")

    import numpy as np

    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.engine.llm_engine import LLMEngine
    from deepinfer_jax.engine_config import EngineConfig
    from deepinfer_jax.models.registry import DEFAULT_MODEL, resolve_model
    from deepinfer_jax.sampling.params import SamplingParams
    from deepinfer_jax.tokenizer.loader import load_tokenizer

    model_dir = resolve_model(args.model or DEFAULT_MODEL, progress=False)
    cfg = ModelConfig.from_json(model_dir)
    tok = load_tokenizer(model_dir, bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id)
    rng = np.random.default_rng(args.seed)
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    table = []
    print(f"host: {cpu_model()}; model {os.path.basename(model_dir)}; {args.input_len} prompt + "
          f"{args.output_len} output tokens a request; medians over decode steps, ms")
    print(f"{'rows':>5} {'mode':6} {'spec':6} {'steps':>6} " + " ".join(f"{p:>9}" for p in PHASES)
          + f" {'total':>8} {'prefill total':>14}   (total: plan + inputs + results)")
    for R, spec, mode in ((R, spec, mode) for R in args.rows for spec in specs for mode in modes):
        # every prompt in the first step, then R decode rows a step (verification rows with
        # speculation: buckets of R, 2R, ... (K+1)R tokens)
        K = cfg.dspark_block_size if spec != "none" else 0  # EngineConfig's default num_draft_tokens
        kw = dict(spec_decode="dspark", spec_varlen=(spec != "fixed")) if spec != "none" else {}
        prefill = max(R * args.input_len, R * (K + 1))
        ec = EngineConfig.from_kwargs(max_num_seqs=R, max_num_batched_tokens=prefill, precompile=False,
                                      token_buckets=tuple(sorted({R * (k + 1) for k in range(K + 1)} | {prefill})),
                                      **kw)
        ec = ec.resolve(cfg, "cpu")
        prompts = [rng.integers(4, min(cfg.vocab_size, tok.vocab_size), args.input_len).tolist() for _ in range(R)]
        if spec != "none" and not cfg.dspark_enabled:
            ap.error(f"--spec {spec}: model {os.path.basename(model_dir)} has no DSpark stages")
        if True:
            runner = host_only_runner(model_dir, ec, cfg, args.seed, args.accept)
            engine = LLMEngine(runner, dataclasses.replace(ec, async_scheduling=(mode == "async")), tok,
                               cfg.eos_token_id, vocab_size=cfg.vocab_size)
            engine.forward_estimator = None  # plan from the modelled curve, not the fake steps' times
            if spec == "plain":  # every step plain, as varlen's switch chooses where verifying does not pay
                engine.scheduler._plan_drafts = lambda budget: ({}, True)
            engine.add_requests([(f"r{i}", p, sp) for i, p in enumerate(prompts)])
            t0 = time.perf_counter()
            outs = engine.run_until_done()
            wall = time.perf_counter() - t0
            assert len(outs) == R and all(len(o.outputs[0].token_ids) == args.output_len for o in outs)
            dec = [s for s in engine.stats.steps if s.num_prefill_tokens == 0 and s.num_rows == R]
            pre = [s for s in engine.stats.steps if s.num_prefill_tokens > 0]
            med = {p: 1e3 * statistics.median(getattr(s, p + "_s") for s in dec) for p in PHASES} if dec else {}
            total = sum(v for p, v in med.items() if p != "call")
            pre_total = 1e3 * statistics.median(sum(getattr(s, p + "_s") for p in OWN) for s in pre) if pre else 0.0
            summ = engine.stats.summary()
            table.append(dict(rows=R, mode=mode, spec=spec, decode_steps=len(dec), steps=len(engine.stats.steps),
                              median_ms=med, decode_total_ms=total, prefill_total_ms=pre_total, wall_s=wall,
                              mean_accepted_length=summ["mean_accepted_length"],
                              drafts_per_row=summ["drafts_verified"] / max(summ["spec_rows"], 1)))
            print(f"{R:5d} {mode:6} {spec:6} {len(dec):6d} " + " ".join(f"{med.get(p, 0):9.3f}" for p in PHASES)
                  + f" {total:8.3f} {pre_total:14.3f}"
                  + (f"   drafts/row {table[-1]['drafts_per_row']:.2f}, tau {summ['mean_accepted_length']:.2f}"
                     if spec not in ("none", "plain") else ""))
    out = args.out or os.path.join("benchmarks", "results", f"host_path_{platform.machine()}.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    import jax

    try:
        import subprocess

        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    except OSError:
        commit = None
    with open(out, "w") as f:
        json.dump({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": commit,
                   "host": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
                   "numpy": np.__version__, "jax": jax.__version__, "model": os.path.basename(model_dir),
                   "args": vars(args), "table": table}, f, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
