"""EPLB in the engine (``EngineConfig.eplb_redundant_experts``, ``runner/dp_runner.py``): redundant
physical expert slots, routing through them, the load window and rebalancing with weight moves.

On 4 CPU devices (a subprocess) the v41-tiny model's routers are skewed towards experts 0 and 1
(their gate biases raised, in the plain engine and the EPLB engine alike), so that the devices
holding those experts carry most of the load. The EPLB engine (8 experts + 4 redundant slots,
``dp=4``) must give the plain one-device engine's tokens before a rebalance, after it, and with
rebalances every few steps during generation (those with the step calls on the launcher
thread, ``EngineConfig.dispatch_thread``); the busiest device's load must fall.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cpu_devices import cpu_devices_env

REPO = Path(__file__).resolve().parent.parent

_SCRIPT = textwrap.dedent("""
    import json
    import jax, numpy as np
    from deepinfer_jax import LLM, SamplingParams

    def skew(llm):  # experts 0 and 1 preferred by every router
        tree = jax.tree.unflatten(llm.runner.state_treedef, llm.runner.state_leaves)
        for i, (path, x) in enumerate(jax.tree_util.tree_flatten_with_path(tree)[0]):
            k = jax.tree_util.keystr(path)
            if k.startswith("['layers']") and "['ffn']['gate']['bias']" in k:
                llm.runner.state_leaves[i] = x.at[:2].add(4.0)

    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 250, size=int(n)).tolist() for n in (7, 60, 33, 90, 12, 75, 48, 20)]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    kw = dict(max_num_seqs=4, max_num_batched_tokens=64, token_buckets=(64,), row_buckets=(4,), max_model_len=256,
              progress=False)
    tok = lambda outs: [o.outputs[0].token_ids for o in outs]
    plain = LLM({ckpt!r}, **kw)
    skew(plain)
    ref = tok(plain.generate(prompts, sp, use_tqdm=False))
    llm = LLM({ckpt!r}, dp=4, eplb_redundant_experts=4, eplb_interval=0, **kw)
    skew(llm)
    r = llm.runner
    before = tok(llm.generate(prompts, sp, use_tqdm=False))
    load_before = r.rank_load().tolist()
    total_before = int(r.expert_load().sum())
    r.rebalance()
    after = tok(llm.generate(prompts, sp, use_tqdm=False))
    load_after = r.rank_load().tolist()
    # the automatic rebalances with the step calls on the launcher thread (dispatch_thread): a
    # rebalance waits for the queued calls before it moves weights they read
    auto = LLM({ckpt!r}, dp=4, eplb_redundant_experts=4, eplb_interval=3, eplb_window=4, dispatch_thread=True, **kw)
    skew(auto)
    during = tok(auto.generate(prompts, sp, use_tqdm=False))
    print(json.dumps(dict(ref=ref, before=before, after=after, during=during, load_before=load_before,
                          load_after=load_after, total_before=total_before, rebalances=auto.runner.rebalances,
                          slots=list(r.eplb_sizes), phy2log=np.asarray(r.placement.phy2log_LR).tolist())))
""")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    from deepinfer_jax.checkpoint.random_checkpoint import write_random_checkpoint
    from deepinfer_jax.config import preset

    d = tmp_path_factory.mktemp("v41_tiny_eplb")
    write_random_checkpoint(preset("v41-tiny"), d, seed=3, progress=False)
    return d


def test_rebalance_lowers_the_busiest_device_and_changes_no_token(ckpt):
    r = subprocess.run([sys.executable, "-c", _SCRIPT.format(ckpt=str(ckpt))], env=cpu_devices_env(4), cwd=str(REPO),
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-5000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["before"] == res["ref"] and res["after"] == res["ref"] and res["during"] == res["ref"]
    assert res["rebalances"] >= 2
    E, R = res["slots"]
    assert (E, R) == (8, 12)
    before, after = res["load_before"], res["load_after"]   # [layers][devices], the same workload
    assert sum(map(sum, before)) == sum(map(sum, after)) == res["total_before"] > 0
    for l, (b, a) in enumerate(zip(before, after)):
        share = sum(b) / len(b)
        assert max(b) > 1.5 * share, (l, b)          # the skew: one device well above its share
        assert max(a) < 0.8 * max(b), (l, b, a)      # after: the busiest device carries much less
    # the hot experts got the spare slots
    for row in res["phy2log"]:
        assert row.count(0) + row.count(1) > 2 + 2
