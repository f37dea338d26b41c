"""The step builder's fast paths for one-token rows (decode steps: ``build_step_input``'s
token maps, ``_engram_ids``' reversed-history windows, ``pack_batch``'s ``one_token_rows``) and
the decoder view of a step that skips no token (``forward_batch._full_decoder_view``) and
the sampler's slice writes (``sampling.sampler._row_index``) give exactly the arrays of the
general paths, on random decode steps: placeholders or known tokens, short and full Engram
look-backs, equal and ragged block lists, rows that do not sample, shared and own params, bans,
decoder views, verification slots."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from deepinfer_jax.base import forward_batch
from deepinfer_jax.base.scheduler_output import ScheduledRow, SchedulerOutput
from deepinfer_jax.config import preset
from deepinfer_jax.models.cache import CacheConfig
from deepinfer_jax.runner import step_inputs
from deepinfer_jax.runner.engram_hash import EngramHasher
from deepinfer_jax.sampling import sampler
from deepinfer_jax.sampling.params import SamplingParams

CFG = preset("v41-tiny")
VOCAB = CFG.vocab_size


def _random_step(rng, hasher, nr: int) -> SchedulerOutput:
    Km1 = hasher.max_ngram_size - 1
    ph_mode = rng.choice(["all", "none", "mixed"])
    full_lookback = rng.random() < 0.7  # every start >= K-1: the reversed-history windows
    equal_blocks = rng.random() < 0.5
    nb = int(rng.integers(0, 5))
    shared = SamplingParams(temperature=float(rng.choice([0.0, 0.7])), top_k=int(rng.integers(0, 9))).validate()
    rows = []
    for i in range(nr):
        start = int(rng.integers(Km1, 300)) if full_lookback else int(rng.integers(0, 300 if i % 2 else Km1 + 1))
        ph = ph_mode == "all" or (ph_mode == "mixed" and rng.random() < 0.5)
        known = 0 if ph else 1
        w0 = max(start - Km1, 0)
        history = rng.integers(0, VOCAB, size=start + known - w0).tolist()
        floor = int(rng.integers(0, start + 1))
        sample = bool(rng.random() < 0.95)
        # above floor: a decoder floor (at start + 1: a row whose token no decoder layer computes,
        # an error if it samples)
        dec_floor = int(rng.integers(floor, start + 2)) if rng.random() < 0.2 else floor
        params = shared if rng.random() < 0.7 else SamplingParams(temperature=float(rng.uniform(0.1, 2)),
                                                                   top_p=float(rng.uniform(0.5, 1))).validate()
        banned = rng.integers(0, VOCAB, size=int(rng.integers(1, 4))).tolist() if rng.random() < 0.1 else []
        rows.append(ScheduledRow(
            f"r{i}", 0, start, [-1] if ph else history[-1:], int(rng.integers(0, 64)) if ph else -1,
            sample, int(rng.integers(0, 64)),
            rng.integers(0, 500, size=nb if equal_blocks else int(rng.integers(0, 5))).tolist(),
            floor, dec_floor, int(rng.integers(0, start + 1)), False, params,
            int(rng.integers(0, 2**64, dtype=np.uint64)), banned, False, None, history))
    return SchedulerOutput(0, rows, [], 0, [])


def _general(monkeypatch):
    monkeypatch.setattr(step_inputs, "_one_token_rows", lambda n_R, total: False)
    monkeypatch.setattr(forward_batch, "_no_skipped_tokens", lambda first_R: False)
    monkeypatch.setattr(sampler, "_row_index", lambda row_R: row_R)


def _build(sched, kw):
    try:
        return step_inputs.build_step_input(sched, **kw)
    except ValueError as e:
        return str(e)


def test_one_token_fast_paths_equal_general_paths(monkeypatch):
    hasher = EngramHasher.from_model_config(CFG, token_map=np.arange(VOCAB) % CFG.engram_compressed_vocab_size)
    cc = CacheConfig(num_slots=64, num_blocks=512, block_tokens=16, max_blocks_per_seq=6)
    rng = np.random.default_rng(0)
    fast_hits = 0
    for trial in range(300):
        nr = int(rng.integers(1, 40))
        sched = _random_step(rng, hasher, nr)
        pad = int(rng.integers(0, 5))
        K = int(rng.choice([0, 0, 2]))
        kw = dict(num_tokens=nr + pad, num_rows=nr + pad, cache_config=cc, hasher=hasher, vocab=VOCAB,
                  prompt_lp=False, spec_slots=K,
                  num_decoder_tokens=nr + pad if rng.random() < 0.5 else None)
        got, want = _build(sched, kw), None
        with monkeypatch.context() as m:
            _general(m)
            want = _build(sched, kw)
        if isinstance(want, str):  # the same error
            assert got == want, trial
            continue
        fast_hits += all(r.start >= hasher.max_ngram_size - 1 for r in sched.rows)
        bt = np.zeros((nr + pad, cc.max_blocks_per_seq), np.int32)  # (equal block lists: one reshape)
        for i, r in enumerate(sched.rows):
            bt[i, :len(r.blocks)] = r.blocks
        np.testing.assert_array_equal(got.batch.block_table, bt)
        lg, tg = jax.tree.flatten(got)
        lw, tw = jax.tree.flatten(want)
        assert tg == tw, trial
        for a, b in zip(lg, lw):
            assert a.dtype == b.dtype and a.shape == b.shape, trial
            np.testing.assert_array_equal(a, b, err_msg=f"trial {trial}")
    assert fast_hits > 100


def test_one_token_fast_path_keeps_the_history_check():
    hasher = EngramHasher.from_model_config(CFG, token_map=np.arange(VOCAB) % CFG.engram_compressed_vocab_size)
    cc = CacheConfig(num_slots=64, num_blocks=512, block_tokens=16, max_blocks_per_seq=6)
    sched = _random_step(np.random.default_rng(1), hasher, 8)
    sched.rows[3].history = sched.rows[3].history[1:]
    with pytest.raises(ValueError, match="row of request 'r3': history holds"):
        step_inputs.build_step_input(sched, num_tokens=8, num_rows=8, num_decoder_tokens=None, cache_config=cc,
                                     hasher=hasher, vocab=VOCAB, prompt_lp=False)


def test_sampling_reuse_equals_fresh_batches():
    """``sampling_batch_of(reuse=...)`` over a run of steps (rows, params objects, seeds, bans,
    widths changing or not between steps) gives every step the arrays of a fresh build, and the
    reused arrays are read-only."""
    rng = np.random.default_rng(2)
    shared = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9),
              SamplingParams(temperature=1.3, top_k=7, min_p=0.05)]
    reuse = sampler.SamplingReuse()
    n, num_rows = 5, 8
    params = [shared[0]] * n
    seeds = rng.integers(0, 2**63, n).tolist()
    hits = 0
    for step in range(400):
        change = rng.random()
        if change < 0.1:
            n = int(rng.integers(1, num_rows + 1))
            params = [shared[int(rng.integers(3))] for _ in range(n)]
            seeds = rng.integers(0, 2**63, n).tolist()
        elif change < 0.2:
            params = list(params)
            params[int(rng.integers(n))] = SamplingParams(temperature=float(rng.uniform(0.1, 2)))
        elif change < 0.3:
            seeds = list(seeds)
            seeds[int(rng.integers(n))] = int(rng.integers(0, 2**63))
        elif change < 0.35:
            num_rows = max(n, int(rng.integers(1, 12)))
        else:
            hits += 1
        which = np.arange(n) if rng.random() < 0.9 else np.sort(rng.choice(num_rows, n, replace=False))
        pos = rng.integers(0, 2**31, n)
        banned = [rng.integers(0, 100, int(rng.integers(1, 3))).tolist() if rng.random() < 0.05 else []
                  for _ in range(n)]
        got = sampler.sampling_batch_of(which, params, list(seeds), pos, banned, num_rows, 100, num_banned=4,
                                        reuse=reuse)
        want = sampler.sampling_batch_of(which, params, list(seeds), pos, banned, num_rows, 100, num_banned=4)
        for f in ("temperature", "top_k", "top_p", "min_p", "seed", "position", "banned_RB"):
            np.testing.assert_array_equal(getattr(got, f), getattr(want, f), err_msg=f"step {step}: {f}")
        assert (got.all_greedy, got.needs_filter) == (want.all_greedy, want.needs_filter), step
    assert hits > 200
    assert not got.temperature.flags.writeable or not isinstance(sampler._row_index(which), slice)
