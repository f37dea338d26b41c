"""Balanced context parallelism (FEATURES §6): the mirror layout and the engine's CP steps.

The layout (``base/cp_layout.py``) is checked on the host: every token on exactly one device,
``home_T`` the inverse, a long prompt in 2P mirror chunks with equal causal work per device,
capacity kept when long rows crowd a step.

The engine (a subprocess on 8 CPU devices): a mixed batch (prompts of 5-200 tokens chunked under
a 64-token budget per rank, a second wave of prefix hits, 12-block configurations that preempt,
compact YOCO truncation) on one device and with every step's tokens split over the cp devices:
``dp=2 x cp=4`` (all-to-all EP, EPLB load counting), ``cp=8`` (psum EP, DSpark speculation) and
``dp=2 x cp=4`` without YOCO truncation (the decoder layers split too).
All runs use ``batch_invariant=True``, whose logits do not depend on the step's shape, so a CP
run must give the one-device logprobs bit for bit; without it a CP device's step has ``T / P``
tokens instead of ``T`` and rounds differently (as any change of the step shape does).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cpu_devices import cpu_devices_env
from deepinfer_jax.base.cp_layout import mirror_chunks, mirror_layout

REPO = Path(__file__).resolve().parent.parent


def _assignment(lay, total: int) -> np.ndarray:
    """Device of each of the ``total`` flat tokens, checking the layout is a permutation."""
    idx, ok, home = np.asarray(lay.index_PN), np.asarray(lay.valid_PN), np.asarray(lay.home_T)
    P, N = idx.shape
    toks = idx[ok]
    assert sorted(toks.tolist()) == list(range(total)), "every token on exactly one device"
    dev = np.zeros(total, np.int64)
    for p in range(P):
        dev[idx[p][ok[p]]] = p
        assert np.all(np.diff(idx[p][ok[p]]) > 0), "a device's tokens in flat order"
    for t in range(total):   # home_T is the inverse: the slot it names holds the token
        p, n = divmod(int(home[t]), N)
        assert idx[p, n] == t and ok[p, n]
    return dev


@pytest.mark.parametrize("P", [2, 4, 8])
def test_long_prompt_is_mirrored_with_equal_causal_work(P):
    n = 1000
    lay = mirror_layout([n], 1024, P)
    dev = _assignment(lay, n)
    # 2P chunks, device p holds chunks p and 2P-1-p
    chunk = (np.arange(n) * 2 * P) // n
    np.testing.assert_array_equal(dev, np.minimum(chunk, 2 * P - 1 - chunk))
    np.testing.assert_array_equal(dev, mirror_chunks(n, P))
    # causal work (keys a query attends to: its position + 1) per device, also for a later
    # chunk of a prompt (positions 3000..3999)
    for start in (0, 3000):
        work = np.bincount(dev, weights=start + np.arange(n) + 1.0, minlength=P)
        # equal up to the rounding of chunk sizes: at most one latest query's keys apart
        assert work.max() - work.min() <= start + n, work
    # the plain split (contiguous quarters) would leave the last device ~7x the first's work at P=4
    plain = np.bincount(np.arange(n) * P // n, weights=np.arange(n) + 1.0, minlength=P)
    assert plain.max() / plain.min() > 2


def test_mixed_rows_fill_devices_evenly_and_keep_capacity():
    rng = np.random.default_rng(1)
    P, T = 4, 256
    lengths = [1, 1, 1, 90, 1, 57, 3, 1, 40, 1]     # decode tokens and prompt chunks
    lay = mirror_layout(lengths, T, P)
    dev = _assignment(lay, sum(lengths))
    counts = np.bincount(dev, minlength=P)
    assert counts.max() - counts.min() <= 2, counts
    # a step full of long rows: no device over its T / P slots
    full = [64, 64, 64, 64]
    dev = _assignment(mirror_layout(full, T, P), T)
    assert np.bincount(dev, minlength=P).tolist() == [64] * 4
    lengths = rng.integers(1, 80, 6).tolist()
    lengths.append(T - sum(lengths))
    dev = _assignment(mirror_layout(lengths, T, P), T)
    assert np.bincount(dev, minlength=P).tolist() == [64] * 4


def test_layout_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_tokens=100 must divide over cp=8"):
        mirror_layout([10], 100, 8)
    with pytest.raises(ValueError, match="300 tokens > num_tokens=256"):
        mirror_layout([200, 100], 256, 4)


_SCRIPT = """
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
            block_tokens=32, enable_prefix_caching=True, prefix_replay="exact", batch_invariant=True, progress=False)
split = dict(cp_min_tokens=64)   # every step (bucket 64) splits over cp
configs = [dict(num_blocks=12),
           dict(dp=2, cp=4, num_blocks=12, eplb_redundant_experts=8, eplb_interval=0, **split),
           dict(dp=2, cp=4, num_blocks=12, eplb_redundant_experts=8, eplb_interval=0, cp_min_tokens=None),
           dict(cp=8, num_blocks=24, ep_scheme="psum", spec_decode="dspark", spec_varlen=False, **split),
           # no YOCO truncation: the decoder layers run split over cp too (their own reference)
           dict(num_blocks=12, yoco_truncation="off"),
           dict(dp=2, cp=4, num_blocks=12, yoco_truncation="off", **split)]
report = []
for extra in configs:
    llm = LLM({ckpt!r}, **base, **extra)
    outs = [o for w in (wave1, wave2) for o in llm.generate(w, sp, use_tqdm=False)]
    r = llm.runner
    rec = dict(config=extra,
               tokens=[o.outputs[0].token_ids for o in outs],
               logprobs=[[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                         for o in outs],
               cached=sum(o.num_cached_tokens for o in outs),
               preemptions=sum(o.outputs[0].metrics.num_preemptions for o in outs),
               split_steps=getattr(r, "cp_split_steps", 0),
               layer_loads=r.expert_load().sum(axis=1).tolist() if getattr(r, "placement", None) is not None else None)
    report.append(rec)
    del llm
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    from deepinfer_jax.checkpoint.random_checkpoint import write_random_checkpoint
    from deepinfer_jax.config import preset

    d = tmp_path_factory.mktemp("v41_tiny_cp")
    write_random_checkpoint(preset("v41-tiny"), d, seed=11, progress=False)
    return d


def test_cp_engine_equals_one_device_bit_for_bit(ckpt):
    r = subprocess.run([sys.executable, "-c", _SCRIPT.format(ckpt=str(ckpt))], env=cpu_devices_env(8), cwd=str(REPO),
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, f"8-device run failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    ref, cp_eplb, no_split, cp8, ref_off, cp_off = json.loads(r.stdout.strip().splitlines()[-1])
    assert ref["preemptions"] > 0, "the batch should preempt on one device"
    for want, run in ((ref, cp_eplb), (ref, no_split), (ref, cp8), (ref_off, cp_off)):
        assert run["tokens"] == want["tokens"], run["config"]
        assert run["logprobs"] == want["logprobs"], run["config"]   # bit for bit
    assert cp_eplb["split_steps"] > 0 and cp8["split_steps"] > 0 and no_split["split_steps"] == 0
    assert cp_eplb["preemptions"] > 0 and cp8["cached"] > 0
    # the CP step counts every routed (token, slot) once over its cp devices: the same per-layer
    # totals as the step that runs every token on every cp device
    assert cp_eplb["layer_loads"] == no_split["layer_loads"] and min(cp_eplb["layer_loads"]) > 0
