"""Cache consistency of the ragged forward step: however a sequence's tokens are split into
steps and batched with other sequences, the logits (and greedy tokens) must be those of one
one-shot prefill.

Setup: one random ``v41-tiny`` checkpoint (seed 0; window 8, ratio-2 and ratio-1 compressed
layers, shared KV/index sources, candidate blocks, Engram, mHC, DSpark) and a fresh
``SequenceDriver`` per scenario. Prompt lengths (37, 50, 23, ...) wrap the window ring several
times, and odd chunk boundaries split ratio-2 groups across steps.

Shapes and tolerance
--------------------
Every step here runs at ONE padded shape: ``T_BUCKET`` tokens, ``R_BUCKET`` rows and
``T_BUCKET`` logit rows (explicit, padded logit indices). Two reasons:

* compile time: one step executable costs ~20 s to compile on the 2-core CPU; a shape per
  chunk length would take minutes.
* with the shape fixed, every token goes through the same compiled arithmetic whatever the
  chunking, so any difference comes from the cache / ragged-batch logic and nothing else. The
  outputs are then expected to be bitwise equal (observed: max |diff| = 0.0).

Why not a loose "bf16-sized" tolerance across different shapes: activations are bf16 and every
fp8/fp4 matmul first QDQs its input (fp8 e4m3: 3 mantissa bits), the compressed KV and indexer
q/k are fp4-QDQ'd, and the indexer picks a discrete top-k. A 1-ulp fp32/bf16 difference
(e.g. XLA CPU's softmax/exp differing by 1 ulp between T=50 and T=64 in the ratio-2
compressor) can cross a fp4 rounding boundary, change an index score enough to swap a top-k
entry, and then change whole attention outputs: one-shot prefill of the same 50-token prompt at
T=50 vs T=64 differs by 0.68 max |logit| (logit std ~1.0) and flips greedy tokens (see
``test_step_shape_invariance``, marked slow + xfail; in batch-invariant mode the two are bitwise
equal, ``test_step_shape_invariance_batch_invariant``). So there is no tolerance that is both
meaningful for a cache bug and robust to a changed T; we fix T and demand equality up to
``ATOL``/``RTOL`` = 1e-5 on fp32 logits of magnitude <~5, i.e. far below one bf16 ulp
(2^-8 relative) of any activation — a cache bug that changes a single bf16 value anywhere upstream fails it.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from deepinfer_jax.config import preset
from deepinfer_jax.models.cache import CacheConfig
from deepinfer_jax.runner.engram_hash import EngramHasher
from deepinfer_jax.runner.sequence_driver import SequenceDriver
from deepinfer_jax.checkpoint.random_checkpoint import write_random_checkpoint
from deepinfer_jax.models.weights import load_model

CC = CacheConfig(num_slots=4, num_blocks=32, block_tokens=32, max_blocks_per_seq=4)  # max_model_len 128
T_BUCKET = 64   # tokens per step (padded)
R_BUCKET = 2    # rows per step (padded)
ATOL = RTOL = 1e-5
W = 8           # v41-tiny sliding_window
LOW, HIGH = 3, 250  # prompt token ids (no specials, no DSpark noise id 255)


# ----------------------------------------------------------------------------- fixtures / helpers


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("v41_tiny_seed0")
    cfg = preset("v41-tiny")
    write_random_checkpoint(cfg, d, seed=0, progress=False)
    model = load_model(d)
    assert model.cfg.sliding_window == W
    hasher = EngramHasher.from_model_config(model.cfg, os.path.join(d, "tokenizer.json"))
    return model, hasher


def prompt(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(LOW, HIGH, length).tolist()


class Runner:
    """A fresh SequenceDriver whose steps all run at the fixed padded shape."""

    def __init__(self, tiny, batch_invariant: bool = False):
        model, hasher = tiny
        self.drv = SequenceDriver(model, CC, hasher, batch_invariant=batch_invariant)

    def step(self, chunks, which: str = "all") -> list[np.ndarray]:
        """One ragged step; returns each chunk's logits (``all``: [len, V], ``last``: [1, V])."""
        idx, spans, o = [], [], 0
        for _, toks in chunks:
            n = len(toks)
            sel = list(range(o, o + n)) if which == "all" else [o + n - 1]
            spans.append((len(idx), len(sel)))
            idx += sel
            o += n
        assert o <= T_BUCKET and len(chunks) <= R_BUCKET
        lg, _, _ = self.drv.step([(s, [int(t) for t in toks]) for s, toks in chunks],
                                 logits=idx + [0] * (T_BUCKET - len(idx)),
                                 num_tokens=T_BUCKET, num_rows=R_BUCKET)
        return [lg[a:a + n] for a, n in spans]

    def prefill(self, slot: int, toks, lengths=None, which: str = "all") -> np.ndarray:
        """Prefill ``toks`` in chunks of ``lengths`` (default one chunk); concatenated logits."""
        lengths = lengths or [len(toks)]
        assert sum(lengths) == len(toks)
        out, o = [], 0
        for n in lengths:
            out += self.step([(slot, toks[o:o + n])], which)
            o += n
        return np.concatenate(out)

    def draft(self, slot: int, token: int):
        ids, lg, conf, _ = self.drv.draft([slot], [int(token)])
        return ids[0], lg[0], conf[0]


def assert_same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL, err_msg=what)
    bad = np.flatnonzero(got.argmax(-1) != want.argmax(-1))
    assert bad.size == 0, f"{what}: greedy token differs at rows {bad.tolist()}"


def cache_arrays(runner: Runner) -> dict[str, np.ndarray]:
    c = runner.drv.cache
    out = {}
    for field in ("window", "comp_kv", "index_k", "index_k_scale", "comp_state_kv", "comp_state_score",
                  "dspark_window"):
        for i, a in enumerate(getattr(c, field)):
            out[f"{field}[{i}]"] = np.asarray(a).astype(np.float32)
    return out


def split_sets(n: int, seed: int) -> list[list[int]]:
    """Three seeded random chunkings of ``n`` tokens (chunk lengths). Set 0: 3 chunks (at least
    one longer than the window); sets 1 and 2: more cuts plus forced single-token chunks at an
    odd position (a ratio-2 group split 1 + 1 across steps) and a run of single tokens."""
    rng = np.random.default_rng(seed)
    sets = []
    for n_cuts in (2, 5, 9):
        sets.append(set(rng.choice(np.arange(1, n), n_cuts, replace=False).tolist()))
    p = int(rng.integers(W, n - 4)) | 1
    sets[1] |= {p, p + 1}
    q = int(rng.integers(1, n - 4))
    sets[2] |= {q, q + 1, q + 2, q + 3}
    out = []
    for cuts in sets:
        b = [0] + sorted(cuts) + [n]
        out.append([b[i + 1] - b[i] for i in range(len(b) - 1)])
    return out


# ----------------------------------------------------------------------------- 1. chunked prefill


@pytest.mark.parametrize("n, seed", [(37, 11), (50, 12)])
def test_chunked_prefill_matches_one_shot(tiny, n, seed):
    toks = prompt(n, seed)
    ref = Runner(tiny)
    want = ref.prefill(0, toks)
    want_cache = cache_arrays(ref)
    sets = split_sets(n, seed + 100)
    all_chunks = [c for s in sets for c in s]
    assert 1 in all_chunks and max(all_chunks) > W, sets
    starts = [sum(s[:i]) for s in sets for i in range(1, len(s))]
    assert any(p % 2 for p in starts), "no chunk boundary splits a ratio-2 group"
    for lengths in sets:
        r = Runner(tiny)
        got = r.prefill(0, toks, lengths)
        assert_same(got, want, f"'all' logits, chunks {lengths}")
        # the cache the chunked prefill leaves behind is the one-shot cache, entry for entry
        for name, arr in cache_arrays(r).items():
            np.testing.assert_array_equal(arr, want_cache[name], err_msg=f"cache {name}, chunks {lengths}")
        r_last = Runner(tiny)
        last = r_last.prefill(0, toks, lengths, which="last")
        assert last.shape == (len(lengths), want.shape[1])
        ends = np.cumsum(lengths) - 1
        assert_same(last, want[ends], f"'last' logits, chunks {lengths}")


# ----------------------------------------------------------------------------- 2. prefill + decode


@pytest.mark.parametrize("n", [37, 50])
def test_prefill_then_decode_matches_longer_prefill(tiny, n):
    k = 5
    toks = prompt(n + k, 21 + n)
    want = Runner(tiny).prefill(0, toks)
    r = Runner(tiny)
    got = r.prefill(0, toks[:n], which="last")
    assert_same(got, want[n - 1:n], f"prefill({n}) last logits")
    for i in range(k):
        (lg,) = r.step([(0, [toks[n + i]])])
        assert_same(lg, want[n + i:n + i + 1], f"decode step {i} (position {n + i})")


# ----------------------------------------------------------------------------- 3. ragged batch


def test_two_prompts_in_one_ragged_step(tiny):
    a, b = prompt(37, 31), prompt(23, 32)
    # batched: both prompts in one step (slots 1 and 2; blocks 0-1 for a, 2 for b)
    batched = Runner(tiny)
    got_a, got_b = batched.step([(1, a), (2, b)])
    # alone: separate drivers (each prompt gets blocks from 0) ...
    ra, rb = Runner(tiny), Runner(tiny)
    want_a, want_b = ra.prefill(1, a), rb.prefill(2, b)
    assert_same(got_a, want_a, "prompt a batched vs alone")
    assert_same(got_b, want_b, "prompt b batched vs alone")
    # ... and the same slots in separate steps of one driver (b first: other block order)
    seq = Runner(tiny)
    assert_same(seq.prefill(2, b), want_b, "prompt b, separate step")
    assert_same(seq.prefill(1, a), want_a, "prompt a, separate step")
    # the slot number does not matter
    assert_same(Runner(tiny).prefill(0, a), want_a, "prompt a in slot 0")

    # 4 decode steps: batched (row order alternating) vs alone, teacher-forced with the
    # alone run's greedy tokens; the batched greedy tokens must equal them
    ta, tb = int(want_a[-1].argmax()), int(want_b[-1].argmax())
    for i in range(4):
        rows = [(1, [ta]), (2, [tb])] if i % 2 == 0 else [(2, [tb]), (1, [ta])]
        out = dict(zip([s for s, _ in rows], batched.step(rows)))
        (wa,), (wb,) = ra.step([(1, [ta])]), rb.step([(2, [tb])])
        assert_same(out[1], wa, f"decode {i}, prompt a batched vs alone")
        assert_same(out[2], wb, f"decode {i}, prompt b batched vs alone")
        ta, tb = int(wa[0].argmax()), int(wb[0].argmax())


# ----------------------------------------------------------------------------- 4. mixed step


def test_mixed_decode_and_prefill_step(tiny):
    a, b = prompt(40, 41), prompt(30, 42)
    n_a, b_chunks = 37, [12, 11, 7]  # b's second chunk starts at 12, third at 23 (odd)
    want_a = Runner(tiny).prefill(0, a)       # one-shot a: rows 37..39 are the decode logits
    want_b = Runner(tiny).prefill(1, b)
    # separately: a prefills then decodes alone, b prefills in chunks alone
    ra, rb = Runner(tiny), Runner(tiny)
    sep_a = [ra.prefill(0, a[:n_a], which="last")] + [ra.step([(0, [a[n_a + i]])])[0] for i in range(3)]
    sep_b = rb.prefill(1, b, b_chunks)
    # mixed: a decodes while b prefills, in the same steps (row order varies)
    m = Runner(tiny)
    mix_a = [m.prefill(0, a[:n_a], which="last")]
    mix_b = []
    o = 0
    for i, c in enumerate(b_chunks):
        dec, pre = (0, [a[n_a + i]]), (1, b[o:o + c])
        if i == 1:
            lb, la = m.step([pre, dec])
        else:
            la, lb = m.step([dec, pre])
        mix_a.append(la)
        mix_b.append(lb)
        o += c
    mix_a, mix_b, sep_a = np.concatenate(mix_a), np.concatenate(mix_b), np.concatenate(sep_a)
    assert_same(mix_a, sep_a, "decoding request: mixed vs alone")
    assert_same(mix_b, sep_b, "prefilling request: mixed vs alone")
    assert_same(mix_a, want_a[n_a - 1:], "decoding request vs one-shot")
    assert_same(mix_b, want_b, "prefilling request vs one-shot")


# ----------------------------------------------------------------------------- 5. stale state


def test_stale_slot_and_reused_blocks(tiny):
    c, a = prompt(50, 51), prompt(40, 52)
    n_a = 37
    want_a = Runner(tiny).prefill(1, a)
    g = Runner(tiny)
    g.prefill(0, c, [9, 26, 15])
    g.step([(0, [c[0]])])  # one decode step of c
    # a in slot 1 beside a full slot 0 (different blocks than a fresh driver would give it)
    got = g.prefill(1, a[:n_a], [5, 1, 14, 17])
    got = np.concatenate([got] + [g.step([(1, [a[n_a + i]])])[0] for i in range(3)])
    assert_same(got, want_a, "slot 1 next to a used slot 0")

    # reuse slot 0 and c's blocks for a new request without clearing anything (ring, compressor
    # state, compressed / index-key blocks all hold c's values), like an engine recycling them
    g.drv.history[0] = []
    assert g.drv.blocks[0] == [0, 1]
    got = g.prefill(0, a[:n_a], [5, 1, 14, 17])
    got = np.concatenate([got] + [g.step([(0, [a[n_a + i]])])[0] for i in range(3)])
    assert_same(got, want_a, "reused slot 0 and blocks")


# ----------------------------------------------------------------------------- DSpark drafts


@pytest.mark.parametrize("n, seed", [(37, 61), (50, 62)])
def test_drafts_after_chunked_prefill(tiny, n, seed):
    toks = prompt(n + 2, seed)
    ref = Runner(tiny)
    want_lg = ref.prefill(0, toks[:n])
    y = int(want_lg[-1].argmax())
    want = ref.draft(0, y)
    for lengths in split_sets(n, seed):
        r = Runner(tiny)
        r.prefill(3, toks[:n], lengths)
        got = r.draft(3, y)
        np.testing.assert_array_equal(got[0], want[0], err_msg=f"draft tokens, chunks {lengths}")
        np.testing.assert_allclose(got[1], want[1], atol=ATOL, rtol=RTOL, err_msg=f"draft logits {lengths}")
        np.testing.assert_allclose(got[2], want[2], atol=ATOL, rtol=RTOL, err_msg=f"confidence {lengths}")

    # after prefill(n) + 2 decode steps == after one-shot prefill(n + 2)
    ref2 = Runner(tiny)
    y2 = int(ref2.prefill(0, toks)[-1].argmax())
    want2 = ref2.draft(0, y2)
    r = Runner(tiny)
    r.prefill(1, toks[:n])
    for t in toks[n:]:
        (lg,) = r.step([(1, [t])])
    assert int(lg[-1].argmax()) == y2
    got2 = r.draft(1, y2)
    np.testing.assert_array_equal(got2[0], want2[0], err_msg="draft tokens after decode")
    np.testing.assert_allclose(got2[1], want2[1], atol=ATOL, rtol=RTOL, err_msg="draft logits after decode")
    np.testing.assert_allclose(got2[2], want2[2], atol=ATOL, rtol=RTOL, err_msg="confidence after decode")


# ----------------------------------------------------------------------------- shape invariance


@pytest.mark.slow  # one extra ~20-30 s compile; run with `-m slow`
@pytest.mark.xfail(strict=False, reason=(
    "exact numerics are not invariant to the step's token count T: XLA CPU's fp32 softmax in the "
    "ratio-2 compressor differs by 1 ulp between T=50 and T=64, fp4 QDQ + the indexer's discrete "
    "top-k amplify it (max |logit diff| ~0.68, greedy tokens flip). Not a cache bug: both runs are "
    "one-shot prefills of the same prompt."))
def test_step_shape_invariance(tiny):
    """The same one-shot prefill at the driver's native shape (T = prompt length, 1 row) and at
    the padded bucket shape. Costs one extra compile."""
    toks = prompt(50, 12)
    want = Runner(tiny).prefill(0, toks)
    model, hasher = tiny
    native, _, _ = SequenceDriver(model, CC, hasher).step([(0, toks)], logits="all")
    assert_same(native, want, "native T=50 vs padded T=64")


def test_step_shape_invariance_batch_invariant(tiny):
    """``test_step_shape_invariance`` in batch-invariant mode (``base/batch_invariant.py``): the
    T=50 and T=64 prefills give bit-identical logits. Costs two compiles."""
    toks = prompt(50, 12)
    want = Runner(tiny, batch_invariant=True).prefill(0, toks)
    model, hasher = tiny
    native, _, _ = SequenceDriver(model, CC, hasher, batch_invariant=True).step([(0, toks)], logits="all")
    np.testing.assert_array_equal(native, want, err_msg="native T=50 vs padded T=64, batch-invariant")
