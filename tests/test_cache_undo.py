"""Exact rollback of rejected speculative tokens inside the jitted step (``models/cache_undo.py``).

Model: ``v41-tiny`` random weights with layer 2 turned into a ratio-4 KV/index source, so the
cache holds every kind of state: window rings (W = 8), DSpark rings, ratio-2 and ratio-4
compressor state rings, ratio-1/2/4 paged compressed KV and index keys (fp8 codes + scales),
Engram on layers 0-1.

Scenario (one module fixture): three slots prefill several hundred random tokens (rings wrapped
many times, blocks and groups partly filled), slot 3 a shorter prompt. Then

* run A: one step whose rows are ``[y, d_1..d_K]`` for slots 0-2 with accepted counts a (K = 5:
  a = 0, 2, 5 with fp8 index keys; K = 2: a = 0, 1, 2 with bf16 keys, where the ratio-4 state
  ring has r = 4 > K + 1 positions) plus a prefill chunk for slot 3, as
  ``record_undo -> forward -> apply_undo`` with ``reject_T = offset > a`` in one jitted function,
  on a cache with ``CacheConfig(spec_tokens=K)``;
* run B: the same step with the rows ``[y, d_1..d_a]`` only (same padded shape), plain forward;
* run A without the undo (the plain forward of A's batch).

The start positions put a rejected token on a ring wrap, on a group completion whose group holds
kept tokens (ratio 2 and 4), and on a block boundary (``assert_coverage``). Then both runs
continue with the same step and DSpark draft. Checked: the whole cache after the step (and after
the continuation) equals B's bit for bit; without the undo the rings and paged caches differ;
kept tokens' logits, the continuation's logits and the drafts are equal; the prefill row keeps its
writes; the undo step compiles to no cache-sized copy the plain step does not have.

Every step runs at one padded shape (``T`` tokens, ``R`` rows, ``T`` logit rows), so a token's
arithmetic does not depend on the batch around it and everything is compared bit for bit.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from deepinfer_jax.checkpoint.random_checkpoint import write_random_checkpoint
from deepinfer_jax.config import preset
from deepinfer_jax.models.cache import CacheConfig, ModelCache, allocate_cache
from deepinfer_jax.models.cache_undo import apply_undo, fence, record_undo
from deepinfer_jax.models.weights import load_model
from deepinfer_jax.runner.engram_hash import EngramHasher
from deepinfer_jax.runner.sequence_driver import SequenceDriver, _step

# (drafts per verification row K, accepted counts of slots 0-2, prompt lengths = position of each
# slot's y, index key storage). K = 2: the ratio-4 state ring is r = 4 > K + 1 positions.
SCENARIOS = {
    "K5-fp8keys-packedkv": (5, (0, 2, 5), (221, 300, 263), "fp8", "packed"),
    "K2-bf16keys": (2, (0, 1, 2), (222, 301, 263), "bf16", "bf16"),
}
PREFILL_SLOT, PREFILL_LEN, PREFILL_CHUNK = 3, 150, 20
T, R = 128, 4              # tokens and rows of every step
BT, MAX_BLOCKS = 32, 12    # max_model_len 384
LOW, HIGH = 3, 250         # token ids: no specials, no DSpark noise id 255


def undo_config():
    """v41-tiny with a ratio-4 KV/index source at layer 2 (every ratio the model supports)."""
    return dataclasses.replace(
        preset("v41-tiny"), compress_ratios=(0, 2, 4, 1, 1, 1, 0, 0), kv_source_layer_ids=(1, 2, 3),
        index_source_layer_ids=(1, 2, 3, 5)).validate()


def cache_config(spec_tokens: int, index_key_dtype: str = "fp8", kv_cache_dtype: str = "bf16") -> CacheConfig:
    return CacheConfig(num_slots=R, num_blocks=R * MAX_BLOCKS, block_tokens=BT, max_blocks_per_seq=MAX_BLOCKS,
                       index_key_dtype=index_key_dtype, kv_cache_dtype=kv_cache_dtype, spec_tokens=spec_tokens)


@functools.partial(jax.jit, static_argnames=("graphdef", "block_tokens"), donate_argnames=("cache",))
def undo_step(graphdef, state, cache, batch, reject_T, block_tokens: int):
    """record_undo -> forward -> apply_undo, the way a speculative step runs it (``reject_T`` is
    given here; the barrier stands in for the verification that would compute it from the logits)."""
    model = nnx.merge(graphdef, state)
    log = record_undo(cache, batch, block_tokens, model.cfg)
    cache, log = fence(cache, log)
    cache, logits, _ = model(cache, batch)
    cache, logits = jax.lax.optimization_barrier((cache, logits))
    return apply_undo(cache, log, reject_T), logits


def all_logits(chunks) -> list[int]:
    n = sum(len(t) for _, t in chunks)
    return list(range(n)) + [0] * (T - n)


def clone(drv: SequenceDriver) -> SequenceDriver:
    c = copy.copy(drv)
    c.cache = jax.tree.map(jnp.copy, drv.cache)
    c.history = {s: list(h) for s, h in drv.history.items()}
    c.blocks = {s: list(b) for s, b in drv.blocks.items()}
    return c


def named_leaves(cache: ModelCache) -> dict[str, np.ndarray]:
    return {f"{f.name}[{i}]": np.asarray(a) for f in dataclasses.fields(cache)
            for i, a in enumerate(getattr(cache, f.name))}


def bits(a: np.ndarray) -> np.ndarray:
    """The array's bytes as unsigned ints (bitwise comparison for bf16/fp8/f32 alike; -inf == -inf)."""
    return a.view(f"u{a.dtype.itemsize}")


def differing(a: ModelCache, b: ModelCache) -> list[str]:
    la, lb = named_leaves(a), named_leaves(b)
    assert la.keys() == lb.keys()
    return [k for k in la if la[k].shape != lb[k].shape or not np.array_equal(bits(la[k]), bits(lb[k]))]


def assert_coverage(accepted, prompts, k: int, model_w: int) -> None:
    """The scenario's rejected positions hit a ring wrap, a block boundary, and for ratios 2 and 4
    a group completion whose group holds a kept position."""
    rejected = [(y + a, range(y + a + 1, y + k + 1)) for y, a in zip(prompts, accepted)]  # (last kept, rejected)
    assert any(p % model_w < y % model_w for y, (_, rej) in zip(prompts, rejected) for p in rej)
    assert any(p % BT == 0 for _, rej in rejected for p in rej)
    for r in (2, 4):
        assert any((p + 1) % r == 0 and p - r < kept for kept, rej in rejected for p in rej), r


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("v41_tiny_undo")
    write_random_checkpoint(undo_config(), d, seed=0, progress=False)
    model = load_model(d)
    return model, EngramHasher.from_model_config(model.cfg, os.path.join(d, "tokenizer.json"))


@pytest.fixture(scope="module", params=list(SCENARIOS))
def scenario(request, tiny):
    k, accepted, prompts, keys, kv = SCENARIOS[request.param]
    assert_coverage(accepted, prompts, k, model_w=tiny[0].cfg.sliding_window)
    model, hasher = tiny
    cc = cache_config(k, keys, kv)
    drv = SequenceDriver(model, cc, hasher)
    for s in range(R):  # blocks fixed up front: A and B hold the same block tables
        drv._blocks_for(s, cc.max_model_len)
    rng = np.random.default_rng(0)
    ids = lambda n: rng.integers(LOW, HIGH, n).tolist()  # noqa: E731
    for s, n in enumerate(prompts + (PREFILL_LEN,)):
        toks = ids(n)
        for i in range(0, n, T):
            piece = toks[i:i + T]
            drv.step([(s, piece)], logits=all_logits([(s, piece)]), num_tokens=T, num_rows=R)

    rows = [(s, ids(k + 1)) for s in range(len(accepted))]  # [y, d_1..d_K]
    prefill = (PREFILL_SLOT, ids(PREFILL_CHUNK))
    chunks_a = rows + [prefill]
    chunks_b = [(s, t[:a + 1]) for (s, t), a in zip(rows, accepted)] + [prefill]
    reject = np.zeros(T, bool)
    o = 0
    for (_, toks), a in zip(rows, accepted):
        reject[o + a + 1:o + len(toks)] = True
        o += len(toks)

    pre = jax.tree.map(jnp.copy, drv.cache)
    drv_a, drv_b, drv_raw = clone(drv), clone(drv), drv
    batch = drv_a.batch_for(chunks_a, all_logits(chunks_a), T, R)
    drv_a.cache, lg_a = undo_step(drv_a.graphdef, drv_a.state, drv_a.cache, batch, jnp.asarray(reject), BT)
    for (s, toks), a in zip(rows, accepted):  # host bookkeeping: the rejected drafts leave the history
        del drv_a.history[s][len(drv_a.history[s]) - (len(toks) - a - 1):]
    lg_b, _, _ = drv_b.step(chunks_b, logits=all_logits(chunks_b), num_tokens=T, num_rows=R)
    drv_raw.step(chunks_a, logits=all_logits(chunks_a), num_tokens=T, num_rows=R)
    assert drv_a.history == drv_b.history
    after = {k: jax.tree.map(jnp.copy, d.cache) for k, d in (("A", drv_a), ("B", drv_b), ("raw", drv_raw))}

    # the same next step for both: a short row per verification slot, more prefill for slot 3
    nxt = [(s, ids(3)) for s in range(len(accepted))] + [(PREFILL_SLOT, ids(5))]
    cont = {}
    for name, dr in (("a", drv_a), ("b", drv_b)):
        lg, _, _ = dr.step(nxt, logits=all_logits(nxt), num_tokens=T, num_rows=R)
        last = np.cumsum([len(t) for _, t in nxt]) - 1
        y = [int(np.argmax(lg[i])) for i in last]
        cont[name] = (lg[:last[-1] + 1], dr.draft(list(range(R)), y)[:3])
    return dict(model=model, pre=pre, after=after, A=drv_a, B=drv_b, lg_a=np.asarray(lg_a), lg_b=lg_b,
                chunks_a=chunks_a, chunks_b=chunks_b, cont=cont)


def test_rollback_equals_never_proposed(scenario):
    """(a) After the undo the whole cache equals a step that never proposed the rejected drafts."""
    assert differing(scenario["after"]["A"], scenario["after"]["B"]) == []


def test_without_undo_states_differ(scenario):
    """(b) The plain forward of A's batch leaves the rejected drafts in the cache."""
    bad = differing(scenario["after"]["raw"], scenario["after"]["B"])
    cfg = scenario["model"].cfg
    assert all(f"window[{l}]" in bad for l in range(cfg.num_hidden_layers)), bad
    assert all(f"dspark_window[{k}]" in bad for k in range(cfg.num_nextn_predict_layers)), bad
    packed = bool(scenario["after"]["B"].window_scale)
    for i, src in enumerate(cfg.kv_source_layer_ids):  # every source completed a rejected group
        assert f"comp_kv[{i}]" in bad and f"index_k[{i}]" in bad, bad
        assert (f"comp_kv_scale[{i}]" in bad) == packed, bad
        assert (f"comp_state_kv[{i}]" in bad) == (cfg.compress_ratios[src] > 1), bad


def test_kept_token_logits_match(scenario):
    """The kept tokens' logits of the verification step equal run B's (causality, same shape)."""
    oa = ob = 0
    for (_, ta), (_, tb) in zip(scenario["chunks_a"], scenario["chunks_b"]):
        np.testing.assert_array_equal(scenario["lg_a"][oa:oa + len(tb)], scenario["lg_b"][ob:ob + len(tb)])
        oa += len(ta)
        ob += len(tb)


def test_continuation_equal(scenario):
    """(c) The next step's logits, the DSpark drafts after it and the cache then are the same in
    both runs."""
    assert differing(scenario["A"].cache, scenario["B"].cache) == []
    (lg_a, draft_a), (lg_b, draft_b) = scenario["cont"]["a"], scenario["cont"]["b"]
    np.testing.assert_array_equal(lg_a, lg_b)
    for x, y in zip(draft_a, draft_b):  # token ids, logits, confidence
        np.testing.assert_array_equal(x, y)


SLOT_FIELDS = ("window", "window_scale", "dspark_window", "comp_state_kv", "comp_state_score")  # [S, ...]; others [B, ...]


def test_prefill_row_unaffected(scenario):
    """(d) The prefill row of the verification step keeps its writes (reject_T false there): its
    slot's rings and state and its blocks equal run B's, they did change in the step, and its
    logits equal B's."""
    s = PREFILL_SLOT
    a, b = (named_leaves(scenario["after"][k]) for k in ("A", "B"))
    pre = named_leaves(scenario["pre"])
    blocks = np.asarray(scenario["A"].blocks[s])
    ratio_1 = {f"comp_state_{x}[{i}]" for x in ("kv", "score")
               for i, src in enumerate(scenario["model"].cfg.kv_source_layer_ids)
               if scenario["model"].cfg.compress_ratios[src] == 1}
    for k in a:
        part = (lambda x: x[s]) if k.split("[")[0] in SLOT_FIELDS else (lambda x: x[blocks])
        np.testing.assert_array_equal(bits(part(a[k])), bits(part(b[k])), err_msg=k)
        if k not in ratio_1:  # ratio-1 sources keep no state
            assert not np.array_equal(bits(part(a[k])), bits(part(pre[k]))), f"{k}: the prefill row wrote nothing"
    n = len(scenario["chunks_a"][-1][1])
    oa = sum(len(t) for _, t in scenario["chunks_a"][:-1])
    ob = sum(len(t) for _, t in scenario["chunks_b"][:-1])
    np.testing.assert_array_equal(scenario["lg_a"][oa:oa + n], scenario["lg_b"][ob:ob + n])


def test_spec_tokens_validation_and_state_shapes():
    """(e) spec_tokens >= 0 and + 1 <= window; state ring M = max(r, spec_tokens + 1) for r > 1."""
    cfg = undo_config()
    with pytest.raises(ValueError, match=r"CacheConfig.spec_tokens=-1"):
        cache_config(-1).validate(cfg)
    with pytest.raises(ValueError, match=r"CacheConfig.spec_tokens=8: .*sliding window \(8\)"):
        cache_config(8).validate(cfg)
    A = cfg.head_dim
    ratios = [cfg.compress_ratios[s] for s in cfg.kv_source_layer_ids]
    assert ratios == [2, 4, 1]
    for spec, want in ((0, [2, 4, 1]), (5, [6, 6, 1]), (2, [3, 4, 1])):
        c = allocate_cache(cfg, cache_config(spec))
        assert [a.shape for a in c.comp_state_kv] == [(R, m, A) for m in want], spec
        assert [a.shape for a in c.comp_state_score] == [(R, m, A) for m in want], spec


def cache_copies(hlo: str, shapes: set) -> collections.Counter:
    """Cache-shaped ``copy`` instructions of a compiled module, by (dtype, shape)."""
    out = collections.Counter()
    for m in re.finditer(r"= (\w+)\[([\d,]*)\]\S* copy\(", hlo):
        shape = tuple(int(x) for x in m.group(2).split(",") if x)
        if shape in shapes:
            out[(m.group(1), shape)] += 1
    return out


def test_undo_adds_no_cache_copies(tiny):
    """The undo step copies no cache array the plain step does not (the rings' copies of the plain
    step come from reading and writing a ring in one layer): the log costs O(T) rows per array."""
    model, hasher = tiny
    drv = SequenceDriver(model, cache_config(5), hasher)
    batch = drv.batch_for([(0, list(range(LOW, LOW + 6)))], "last", T, R)
    shapes = {tuple(a.shape) for a in jax.tree.leaves(drv.cache)}
    undo = undo_step.lower(drv.graphdef, drv.state, drv.cache, batch, jnp.zeros(T, bool), BT).compile()
    plain = _step.lower(drv.graphdef, drv.state, drv.cache, batch, False).compile()
    assert cache_copies(undo.as_text(), shapes) == cache_copies(plain.as_text(), shapes)
