"""Attention DP + expert parallelism on 8 CPU devices (``runner/dp_runner.py``, FEATURES §6).

One subprocess with ``--xla_force_host_platform_device_count=8`` (JAX in this process may already
run on one device) serves a mixed batch — prompts of 5 to 150 tokens chunked under a 64-token
budget per rank, a second wave sharing 80-token prefixes with the first (prefix hits), blocks
short enough to preempt — on one device and on ``dp=8``, ``dp=4 x cp=2`` (both EP schemes),
``dp=2 x cp=4``, ``dp=2 x cp=4`` with DSpark speculation and ``cp=8`` (EP over 8 without DP;
no step here is long enough to split over cp, ``test_context_parallel.py`` does that), and
reports the greedy tokens,
their logprobs, cache placement and scheduler counts as JSON.

The exchange primitives (``moe_experts_dp``, ``manual.gather_rows``) are checked on random
inputs in a second subprocess against the established EP op and ``jnp.take``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cpu_devices import cpu_devices_env

TESTS_DIR = Path(__file__).resolve().parent
REPO = TESTS_DIR.parent


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    from deepinfer_jax.checkpoint.random_checkpoint import write_random_checkpoint
    from deepinfer_jax.config import preset

    d = tmp_path_factory.mktemp("v41_tiny_dp")
    write_random_checkpoint(preset("v41-tiny"), d, seed=11, progress=False)
    return d


_ENGINE_SCRIPT = """
import json
import numpy as np
import jax
from deepinfer_jax import LLM, SamplingParams

rng = np.random.default_rng(0)
wave1 = [rng.integers(3, 250, size=int(n)).tolist() for n in (5, 200, 37, 190, 120, 66, 12, 180)]
heads = [w[:170] for w in wave1 if len(w) >= 180]
wave2 = [heads[i % len(heads)] + rng.integers(3, 250, size=9).tolist() for i in range(5)]
sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0)
base = dict(max_num_seqs=4, max_num_batched_tokens=64, token_buckets=(64,), row_buckets=(4,), max_model_len=256,
            block_tokens=32, enable_prefix_caching=True, prefix_replay="exact", progress=False)
# 12 blocks (per rank) of 32 tokens preempt; 24 keep wave 1's prefixes cached for wave 2
configs = [dict(num_blocks=12), dict(dp=8, num_blocks=24), dict(dp=4, cp=2, num_blocks=24),
           dict(dp=4, cp=2, num_blocks=24, ep_scheme="psum"), dict(dp=2, cp=4, num_blocks=12),
           dict(dp=2, cp=4, num_blocks=24, spec_decode="dspark", spec_varlen=False), dict(cp=8, num_blocks=24)]
report = []
for extra in configs:
    llm = LLM({ckpt!r}, **base, **extra)
    outs = [o for w in (wave1, wave2) for o in llm.generate(w, sp, use_tqdm=False)]
    dp = extra.get("dp", 1)
    cache = jax.tree.leaves(llm.runner.cache)
    rec = dict(config=extra,
               tokens=[o.outputs[0].token_ids for o in outs],
               logprobs=[[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                         for o in outs],
               cached=[o.num_cached_tokens for o in outs],
               preemptions=sum(o.outputs[0].metrics.num_preemptions for o in outs),
               cache_rows=[(int(x.shape[0]), int(x.sharding.shard_shape(x.shape)[0])) for x in cache],
               cache_bytes=int(sum(x.nbytes for x in cache)),
               device_bytes=[int(sum(s.data.nbytes for x in cache for s in x.addressable_shards if s.device == d))
                             for d in jax.devices()],
               experts_split=any(not x.sharding.is_fully_replicated for x in llm.runner.state_leaves))
    report.append(rec)
    del llm
print(json.dumps(report))
"""


def test_dp_engine_matches_one_device(ckpt):
    code = _ENGINE_SCRIPT.format(ckpt=str(ckpt))
    r = subprocess.run([sys.executable, "-c", code], env=cpu_devices_env(8), cwd=str(REPO), capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, f"8-device run failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    report = json.loads(r.stdout.strip().splitlines()[-1])
    ref, runs = report[0], report[1:]
    n1 = 8  # wave 1's prompts, then wave 2's
    assert ref["preemptions"] > 0, "the batch should preempt on one device"
    for run in runs:
        cfg = run["config"]
        dp, cp = cfg.get("dp", 1), cfg.get("cp", 1)
        assert run["tokens"] == ref["tokens"], cfg
        assert run["experts_split"] and dp * cp == 8
        if dp == 1:  # EP over 8 without DP: one rank, its cache replicated on its 8 cp devices
            assert run["device_bytes"] == [run["cache_bytes"]] * 8
            continue
        if cfg["num_blocks"] == 24 and dp >= 4:  # wave 2 went to the ranks holding its prefixes
            # (5 of 6 blocks hit, less the exact replay: 96 tokens not recomputed)
            assert run["cached"][n1:] == [96] * 5, (cfg, run["cached"])
        elif cfg["num_blocks"] == 24:  # 2 ranks of 4 requests: a prefix may be evicted or its rank full
            assert sum(run["cached"][n1:]) >= 3 * 96, (cfg, run["cached"])
        else:
            assert run["preemptions"] > 0, cfg
        # every cache array split over dp: a device holds 1/dp of it (its rank's slots / blocks)
        assert all(rows == dp * local for rows, local in run["cache_rows"]), (cfg, run["cache_rows"])
        assert run["device_bytes"] == [run["cache_bytes"] // dp] * 8, (cfg, run["device_bytes"])
    by = {json.dumps(run["config"], sort_keys=True): run for run in runs}
    a2a = by[json.dumps(dict(dp=4, cp=2, num_blocks=24), sort_keys=True)]
    psum = by[json.dumps(dict(dp=4, cp=2, num_blocks=24, ep_scheme="psum"), sort_keys=True)]
    assert a2a["logprobs"] == psum["logprobs"]   # bit for bit


_EXCHANGE_SCRIPT = textwrap.dedent("""
    import itertools
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from deepinfer_jax.checkpoint import quant_formats as qf
    from deepinfer_jax.kernels_pallas import moe_ep, moe_gmm_ref
    from deepinfer_jax.sharding import context_parallel, manual
    from deepinfer_jax.sharding.mesh import ParallelConfig, make_mesh

    for dp, cp in ((4, 2), (2, 4), (8, 1)):
        mesh = make_mesh(ParallelConfig(dp=dp, cp=cp))
        for E, fmt in ((8, "bf16"), (16, "fp8"), (4, "bf16")):
            rng = np.random.default_rng(dp * 100 + E)
            T, X, D, F = 11, 3, 128, 64                  # 11 tokens per rank: not a multiple of cp
            x = jnp.asarray(rng.standard_normal((dp * T, D)), jnp.bfloat16)
            idx = jnp.asarray(rng.integers(-1, E, (dp * T, X)), jnp.int32)
            idx = idx.at[:T].set(jnp.asarray(rng.integers(0, 2, (T, X))))   # rank 0 all on experts 0-1
            wt = jnp.asarray(rng.uniform(0.1, 1, (dp * T, X)), jnp.float32)

            def mk(O, K):
                w = rng.standard_normal((E * O, K)).astype(np.float32) / np.sqrt(K)
                if fmt == "bf16":
                    return jnp.asarray(w.reshape(E, O, K), jnp.bfloat16), None
                q, s = qf.quantize_fp8_block(w)
                return jnp.asarray(q.reshape(E, O, K)), jnp.asarray(s.reshape(E, O // 32, K // 32))

            ws = tuple(mk(*s) for s in ((F, D), (D, F), (F, D)))
            axes = moe_ep.expert_axes(mesh, E)
            sh = NamedSharding(mesh, P(axes if axes else None))
            placed = tuple(tuple(None if a is None else jax.device_put(a, sh) for a in w) for w in ws)
            with jax.set_mesh(mesh):   # the established EP op over all ranks' tokens
                ref = jax.jit(lambda *a: moe_ep.moe_experts_ep(moe_gmm_ref.moe_experts_ref, *a, fmt, 0.75, E))(
                    x, idx, wt, *placed)
            wspec = lambda w: tuple(None if a is None else P(axes if len(axes) > 1 else axes[0]) if axes else P() for a in w)
            got = {}
            for scheme in ("a2a", "psum"):
                body = lambda x_, i_, w_, a, b, c, s=scheme: moe_ep.moe_experts_dp(
                    moe_gmm_ref.moe_experts_ref, x_, i_, w_, a, b, c, fmt, 0.75, E, scheme=s)
                f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("dp"), P("dp"), P("dp"), *map(wspec, ws)),
                                          out_specs=P("dp"), check_vma=False))
                got[scheme] = np.asarray(f(x, idx, wt, *placed), np.float32)
                np.testing.assert_array_equal(got[scheme], np.asarray(ref, np.float32))
            if cp > 1:   # a context-parallel step: each device its own 3 tokens (they differ over cp too)
                n_c = dp * cp * 3
                xc = jnp.asarray(rng.standard_normal((n_c, D)), jnp.bfloat16)
                ic = jnp.asarray(rng.integers(-1, E, (n_c, X)), jnp.int32)
                wc = jnp.asarray(rng.uniform(0.1, 1, (n_c, X)), jnp.float32)
                with jax.set_mesh(mesh):
                    ref_c = jax.jit(lambda *a: moe_ep.moe_experts_ep(moe_gmm_ref.moe_experts_ref, *a, fmt, 0.75, E))(
                        xc, ic, wc, *placed)
                for scheme in ("a2a", "psum"):
                    def body(x_, i_, w_, a, b, c, s=scheme):
                        with context_parallel.use(jnp.arange(3), jnp.ones(3, bool)):
                            return moe_ep.moe_experts_dp(moe_gmm_ref.moe_experts_ref, x_, i_, w_, a, b, c, fmt, 0.75,
                                                         E, scheme=s)
                    tok = P(("dp", "cp"))
                    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, *map(wspec, ws)),
                                              out_specs=tok, check_vma=False))
                    np.testing.assert_array_equal(np.asarray(f(xc, ic, wc, *placed), np.float32),
                                                  np.asarray(ref_c, np.float32))
                print("moe cp", dp, cp, E, fmt, axes)
            print("moe", dp, cp, E, fmt, axes)
        # row-split fp8 table with ue8m0 scales: lookups equal jnp.take, bit for bit
        rows = 8 * 6
        tab = jnp.asarray(rng.standard_normal((rows, 64)), jnp.float32).astype(jnp.float8_e4m3fn)
        sc = jnp.asarray(rng.integers(100, 140, (rows, 2)), jnp.uint8)
        ids = jnp.asarray(rng.integers(0, rows, (dp * 5, 3)), jnp.int32)
        tsh = NamedSharding(mesh, P(("dp", "cp")))
        g = jax.jit(jax.shard_map(lambda t, s, i: (manual.gather_rows(t, i, ("dp", "cp")), manual.gather_rows(s, i, ("dp", "cp"))),
                                  mesh=mesh, in_specs=(P(("dp", "cp")), P(("dp", "cp")), P("dp")), out_specs=P("dp"), check_vma=False))
        gv, gs = g(jax.device_put(tab, tsh), jax.device_put(sc, tsh), ids)
        assert np.array_equal(np.asarray(gv).view(np.uint8), np.asarray(jnp.take(tab, ids, axis=0)).view(np.uint8))
        assert np.array_equal(np.asarray(gs), np.asarray(jnp.take(sc, ids, axis=0)))
        print("rows", dp, cp)
    # exact sums keep -0.0 and every bit (an f32 psum of -0.0 and +0.0 gives +0.0)
    mesh = make_mesh(ParallelConfig(dp=8))
    v = jnp.asarray([-0.0, 1e-38, -3.5, float("inf")], jnp.float32)
    f = jax.jit(jax.shard_map(lambda a: manual.exact_sum(jnp.where(jax.lax.axis_index("dp") == 3, a, 0.0), ("dp",)),
                              mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
    assert np.array_equal(np.asarray(f(v)).view(np.uint32), np.asarray(v).view(np.uint32))
    print("sum ok")
""")


def test_dp_exchanges_are_exact():
    """``moe_experts_dp`` (both schemes, experts split over dp x cp, over dp only, over cp only;
    tokens split over dp, or over dp and cp as in a context-parallel step) equals the
    established EP op on all ranks' tokens, bit for bit; ``gather_rows`` equals
    ``jnp.take`` on a row-split fp8 table; ``exact_sum`` keeps every bit."""
    r = subprocess.run([sys.executable, "-c", _EXCHANGE_SCRIPT], env=cpu_devices_env(8), cwd=str(REPO), capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    lines = r.stdout.splitlines()
    assert sum(ln.startswith("moe ") and "cp" not in ln.split()[1] for ln in lines) == 9
    assert sum(ln.startswith("moe cp") for ln in lines) == 6 and sum(ln.startswith("rows") for ln in lines) == 3
    assert "sum ok" in lines


_GRAMMAR_SCRIPT = """
import json
from deepinfer_jax import LLM, SamplingParams
from deepinfer_jax.sampling.params import StructuredOutputsParams
ps = ["x = ", "def f(", "# numbers: ", "y = [", "import "]
sp = [SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex="[0-9]{{3,6}}"))
      if i % 2 == 0 else SamplingParams(temperature=0.0, max_tokens=12) for i in range(len(ps))]
kw = dict(max_num_seqs=4, max_num_batched_tokens=128, token_buckets=(128,), max_model_len=256, progress=False)
print(json.dumps([[o.outputs[0].text for o in LLM(dp=dp, **kw).generate(ps, sp, use_tqdm=False)] for dp in (1, 2)]))
"""


def test_dp_structured_output_matches_one_device():
    """Grammar rows and plain rows spread over 2 ranks (the shipped model, its tokenizer): each
    rank's bitmask rows reach its own sampler rows; the outputs equal one device's."""
    r = subprocess.run([sys.executable, "-c", _GRAMMAR_SCRIPT.format()], env=cpu_devices_env(2), cwd=str(REPO),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    one, two = json.loads(r.stdout.strip().splitlines()[-1])
    assert two == one
    assert all(t.isdigit() and 3 <= len(t) <= 6 for t in one[::2]), one
