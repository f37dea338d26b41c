"""Our model vs the official DeepSeek-V4.1 reference on the golden tiny checkpoints.

Tolerances (see ``tests/golden/v41_tiny/README.md``, "Determinism and observed tolerances"):
* Everything before the first compressed layer is computed bit-identically: Engram output
  exactly, block outputs to within one bf16 ulp on < 1 % of elements (fp32 summation order in
  the mHC expand / MoE sum: 0 on the CPU today, 0.67 % of block 0 on an H200 with layer 0's
  attention bit-exact; ``scripts/golden_report.py`` prints these per layer).
* From there on, a one-ulp bf16 difference can move an fp8 activation-QDQ value by one fp8 step
  (12.5 % relative) or flip a near-tied top-k decision; the README measures a *single* such flip
  in the reference itself at 0.033 (decode logits), 0.080 (DSpark logits), 0.066 (confidence).
  Our runs carry a few such flips per forward, so logits are held to ``max <= 0.3`` (fp8
  storage) and ``mean <= 0.03``; a routing flip at a near-tie (bf16, or DSpark in fp8) can move
  one step's logits further, so the max bound there is 1.0 while the mean bound stays.
* Decode steps are judged one by one: a step whose routed experts equal the reference's at
  every layer is held to the bounds above; a step where one layer's expert choice flipped (a
  near-tie: the README lists gate gaps down to 2.4e-5, below one bf16 ulp of the hidden state)
  only to ``max <= 1.0``. The CPU shows one such step in ``tiny_bf16`` (step 5), an H200 three
  (steps 1, 4, 5). Every step's greedy token must still equal the reference's, and at least one
  step must be flip-free.
* Prefill is judged the same way by rows: the rows before the first discrete decision that
  differs from the reference (candidate blocks, indexer top-k, routed experts; causality keeps
  those rows exact in every decision) are held to the bounds above, the rows from there on to
  ``max <= 1.0``; a decision whose inputs are not downstream of an earlier flip may itself flip
  only at a near-tie (at most one row in 20). XLA's CPU dot changes its fp32 summation order
  between releases (jax 0.12's 21x512 @ 512x24 mHC mix product differs from 0.11's in the last
  ulp of 89 % of its elements), so where these flips land moves with the XLA version; the
  mechanism and so the bounds do not.
* Greedy decode tokens must all equal the reference (the user-visible output). Prefill argmax
  over all positions must agree on >= 90 % (the README lists prefill top-1/top-2 gaps down to
  3e-5) and on the last position; DSpark drafts on >= 90 % (draft gaps down to 0.006).
"""

from __future__ import annotations

import numpy as np
import pytest

from golden_run import cache_entries, run_golden

CLEAN = ("tiny_fp8", "tiny_bf16", "tiny_fp8_long_allsel")  # no top-k ties in the reference run
LOGIT_MAX = {"tiny_fp8": 0.3, "tiny_bf16": 1.0, "tiny_fp8_long_allsel": 0.3}
LOGIT_MEAN = 0.03
DSPARK_MEAN = 0.06  # draft logits carry the Markov bias on top: README's own noise there is 0.08 max
DSPARK_MAX = 1.0
CONF_MAX = 0.3
# A draft token may differ from the reference's only where the reference itself nearly ties:
# its top-two logits closer than this (about twice DSPARK_MEAN, the drafts' mean logit error;
# the golden drafts have margins from 0.01 up, and flips are seen at 0.01-0.04).
DRAFT_NEAR_TIE = 0.12


@pytest.fixture(scope="module", params=CLEAN)
def run(request, golden_dir):
    return request.param, run_golden(str(golden_dir), request.param)


def check_logits(ours, ref, max_tol, what, mean_tol=LOGIT_MEAN):
    d = np.abs(ours - ref)
    assert np.isfinite(ours).all(), f"{what}: non-finite values"
    assert d.max() <= max_tol, f"{what}: max |diff| {d.max():.4g} > {max_tol}"
    assert d.mean() <= mean_tol, f"{what}: mean |diff| {d.mean():.4g} > {mean_tol}"


def sorted_positions(idx: np.ndarray, width: int) -> np.ndarray:
    """Selected positions ascending, unused (-1) last, cut or padded to ``width``."""
    big = np.iinfo(np.int32).max
    s = np.sort(np.where(idx < 0, big, idx), -1)
    if s.shape[1] < width:
        s = np.pad(s, ((0, 0), (0, width - s.shape[1])), constant_values=big)
    return np.where(s == big, -1, s)[:, :width]


def test_engram_and_first_blocks_bit_level(run):
    name, r = run
    g, taps = r["golden"], r["prefill_taps"]
    ours, ref = taps["engram0_out"].astype(np.float32), g["prefill_engram0_out"][0]
    np.testing.assert_allclose(ours, ref, rtol=2**-7, atol=1e-5)  # one bf16 ulp, or cancellation near 0
    assert (ours != ref).mean() < 1e-3
    first_compressed = min(i for i, c in enumerate(r["cfg"].compress_ratios) if c)
    # blocks before the first compressed layer; from there on the ratio-2 compressor latent is
    # within one bf16 ulp (not bit-equal) and fp4/fp8 QDQ amplify that (see module docstring)
    for i in range(first_compressed):
        ours, ref = taps[f"block{i}_h"].astype(np.float32), g[f"prefill_block{i}_h"][0]
        # one bf16 ulp relative, or an fp32-order difference under cancellation near zero
        np.testing.assert_allclose(ours, ref, rtol=2**-7, atol=1e-3, err_msg=f"block {i}")
        assert (ours != ref).mean() < 0.01, f"block {i}: {(ours != ref).mean():.3%} elements differ"
        np.testing.assert_allclose(taps[f"block{i}_pre_mix"], g[f"prefill_block{i}_pre_mix"][0], atol=1e-3)


def prefill_decisions(r) -> list[tuple[str, np.ndarray]]:
    """The prefill's discrete decisions in execution order, as (name, rows where ours differ from
    the reference's): per layer the candidate blocks, the indexer top-k, then the routed experts."""
    g, taps, L, cfg = r["golden"], r["prefill_taps"], len(r["prompt"]), r["cfg"]
    out = []
    for i in range(cfg.num_hidden_layers):
        if f"cand{i}_candidates" in taps and f"prefill_cand{i}_candidates" in g:
            ref = g[f"prefill_cand{i}_candidates"][0].astype(bool)
            ours = taps[f"cand{i}_candidates"][:, :ref.shape[1]].astype(bool)
            out.append((f"candidates {i}", np.where((ours != ref).any(1))[0]))
        if i in cfg.index_source_layer_ids:
            ref = g[f"prefill_index{i}_topk_idxs"][0]
            ref_pos = sorted_positions(np.where(ref >= 0, ref - L, -1), ref.shape[1])
            ours = sorted_positions(taps[f"index{i}_topk"], ref.shape[1])
            out.append((f"index {i}", np.where(~(ours == ref_pos).all(1))[0]))
        ours, ref = np.sort(taps[f"gate{i}_indices"], -1), np.sort(g[f"prefill_gate{i}_indices"], -1)
        out.append((f"gate {i}", np.where(~(ours == ref).all(1))[0]))
    return out


def first_flip_row(r) -> int:
    """The first prompt row where any discrete decision differs from the reference (the prompt's
    length if none). Causality: rows before it see exactly the reference's decisions."""
    rows = [int(f.min()) for _, f in prefill_decisions(r) if f.size]
    return min(rows, default=len(r["prompt"]))


def test_prefill_logits_and_tokens(run):
    """Rows before the first decision flip are held to the fp8-step bound; rows at or after it
    read a different discrete choice (an expert, a selected position) and get the routing-flip
    bound, as decode steps with a flip do."""
    name, r = run
    g = r["golden"]
    ref, ours = g["prefill_logits_all"][0], r["prefill_logits_all"]
    f = first_flip_row(r)
    check_logits(ours, ref, 1.0, "prefill logits")
    if f:
        check_logits(ours[:f], ref[:f], LOGIT_MAX[name], f"prefill logits, rows before the first flip ({f})")
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.9
    assert int(ours[-1].argmax()) == int(g["generated_ids"][0, 0])


def test_prefill_selections(run):
    """Every top-k decision (candidate blocks, indexer, routed experts) whose inputs are not
    downstream of an earlier flip matches the reference, up to near-ties. Inputs there differ
    from the reference by fp32 summation order (XLA's CPU dot vs torch's BLAS; XLA's order also
    changes between releases), which fp8/fp4 QDQ turns into one-step differences; the README
    lists boundary gaps (gate >= 4.1e-5, indexer >= 9.2e-5, candidates >= 6.1e-5) below one such
    step. So a decision may flip where its own gap is that small: rarely, at most one row in 20
    of the comparable rows. Rows after a flip are judged through the logits."""
    name, r = run
    upstream = len(r["prompt"])  # rows at or after this saw an earlier decision flip
    for what, flipped in prefill_decisions(r):
        fresh = flipped[flipped < upstream]
        assert fresh.size <= max(1, upstream // 20), f"{what}: rows {fresh.tolist()} of {upstream} comparable rows"
        if flipped.size:
            upstream = min(upstream, int(flipped.min()))


def routing_flipped(r, step: int) -> bool:
    """Whether our routed experts differ from the reference's at some layer of decode ``step``."""
    g, taps = r["golden"], r["decode_taps"][step]
    for i in range(r["cfg"].num_hidden_layers):
        ref = g.get(f"decode{step}_gate{i}_indices")
        if ref is not None and not (np.sort(np.ravel(taps[f"gate{i}_indices"])) == np.sort(np.ravel(ref))).all():
            return True
    return False


def test_decode_logits_and_tokens(run):
    name, r = run
    g = r["golden"]
    ref = g["decode_logits"][0]
    np.testing.assert_array_equal(r["decode_logits"].argmax(-1), g["generated_ids"][0, 1:])
    flipped = [routing_flipped(r, s) for s in range(ref.shape[0])]
    assert not all(flipped), "every decode step routed differently from the reference"
    for s, flip in enumerate(flipped):
        if flip:
            check_logits(r["decode_logits"][s], ref[s], 1.0, f"decode logits, step {s} (routing flip)", mean_tol=1.0)
        else:
            check_logits(r["decode_logits"][s], ref[s], LOGIT_MAX[name], f"decode logits, step {s}")


def test_dspark_drafts(run):
    name, r = run
    g = r["golden"]
    np.testing.assert_array_equal(r["dspark_ids"][:, 0], g["dspark_output_ids"][0, :, 0])
    ref = g["dspark_logits"][0]
    check_logits(r["dspark_logits"], ref, DSPARK_MAX, "dspark logits", DSPARK_MEAN)
    ours, want = r["dspark_ids"][:, 1:], g["dspark_output_ids"][0, :, 1:]
    np.testing.assert_array_equal(ours, r["dspark_logits"].argmax(-1))
    top2 = np.sort(ref, axis=-1)[..., -2:]
    near_tie = top2[..., 1] - top2[..., 0] < DRAFT_NEAR_TIE
    differ = ours != want
    assert not (differ & ~near_tie).any(), \
        f"draft tokens differ where the reference is decisive: (step, position) {np.argwhere(differ & ~near_tie).tolist()}"
    assert differ.mean() <= 0.2, f"{differ.sum()} of {differ.size} draft tokens differ"
    d = np.abs(r["dspark_confidence"] - g["dspark_confidence"][0])
    assert d.max() <= CONF_MAX, f"confidence max |diff| {d.max():.4g}"


def test_caches_after_prefill_and_decode(run):
    """Window rings, compressed KV and index keys hold the reference's values."""
    name, r = run
    g, cfg = r["golden"], r["cfg"]
    L, S = len(r["prompt"]), g["decode_logits"].shape[1]
    for phase, n_pos in (("after_prefill", L), ("after_decode", L + S)):
        c = r[f"{phase}_cache"]
        np.testing.assert_array_equal(c["window"][0][0], g[f"{phase}_window_kv_cache_L0"][0])
        for k, src in enumerate(cfg.kv_source_layer_ids):
            n = n_pos // cfg.compress_ratios[src]
            ours = cache_entries(c["comp_kv"][k], c["blocks"], n)
            ref = g[f"{phase}_compress_kv_cache_L{src}"][0][:n]
            # fp4 QDQ (3-bit mantissa): a one-ulp input difference can move a value by one e2m1
            # step; the first source sees only bf16-ulp input noise, later ones what accumulated
            ik = cache_entries(c["index_k"][k], c["blocks"], n)
            ik_ref = g[f"{phase}_index_k_cache_L{src}"][0][:n]
            for what, o, rf in (("compressed KV", ours, ref), ("index keys", ik, ik_ref)):
                d = np.abs(o - rf)
                assert d.max() <= 0.5 * np.abs(rf).max(), f"{phase} {what} of layer {src}: max {d.max()}"
                if k == 0:
                    assert (d > 0).mean() < 0.05, f"{phase} {what} of layer {src}: {(d > 0).mean():.1%} differ"
                assert d.mean() <= 0.05 * np.abs(rf).mean(), f"{phase} {what} of layer {src}: mean {d.mean()}"


def test_tied_config_untied_rows(golden_dir):
    """``tiny_fp8_long`` has exact top-k ties whose outcome is torch-CPU specific: everything
    before the first index layer matches, and layer 1's selections match on most untied rows
    (its index keys come from a compressor latent that is within one bf16 ulp of the reference,
    and the README lists indexer boundary gaps of 0 / one bf16 ulp in this config)."""
    r = run_golden(str(golden_dir), "tiny_fp8_long")
    g, taps, L = r["golden"], r["prefill_taps"], len(r["prompt"])
    np.testing.assert_allclose(taps["engram0_out"].astype(np.float32), g["prefill_engram0_out"][0], rtol=2**-7, atol=1e-5)
    np.testing.assert_allclose(taps["block0_h"].astype(np.float32), g["prefill_block0_h"][0], rtol=2**-7, atol=1e-3)
    ref = g["prefill_index1_topk_idxs"][0]
    untied = ~g["prefill_index1_tie_rows"][0]
    assert untied.sum() > 100
    ref_pos = sorted_positions(np.where(ref >= 0, ref - L, -1), ref.shape[1])
    ours = sorted_positions(taps["index1_topk"], ref.shape[1])
    assert (ours[untied] == ref_pos[untied]).all(axis=1).mean() >= 0.8


def test_golden_report_matches_the_run(run, golden_dir):
    """``scripts/golden_report.py`` (the per-layer / per-step diagnostic) reports the same
    routing flips, tokens and logit distances as this run (it reuses the cached run)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "golden_report", Path(__file__).resolve().parents[1] / "scripts" / "golden_report.py")
    golden_report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(golden_report)
    name, r = run
    rep = golden_report.report(str(golden_dir), name)
    g = r["golden"]
    for s, step in enumerate(rep["decode_steps"]):
        assert (step["first_gate_flip"] is not None) == routing_flipped(r, s)
        assert step["token_ok"] == (int(r["decode_logits"][s].argmax()) == int(g["generated_ids"][0, s + 1]))
        assert step["max"] == float(np.abs(r["decode_logits"][s] - g["decode_logits"][0, s]).max())
    b0 = rep["prefill_layers"][0]["block"]
    assert b0[0] == float((r["prefill_taps"]["block0_h"].astype(np.float32) != g["prefill_block0_h"][0]).mean())


def test_packed_kv_cache_is_bit_identical(golden_dir):
    """``CacheConfig.kv_cache_dtype="packed"`` (window rings as fp8 codes + scale bytes, compressed
    entries as fp4 codes + e4m3 scales) holds the same values: a whole golden run (prefill with
    taps, decode, drafts) is bit-identical to the bf16 caches', and so are the decoded caches;
    the packed arrays themselves are 52% / 28% of the bf16 bytes."""
    a = run_golden(str(golden_dir), "tiny_fp8")
    b = run_golden(str(golden_dir), "tiny_fp8", kv_cache_dtype="packed")
    for what in ("prefill_logits_all", "decode_logits", "dspark_ids", "dspark_logits", "dspark_confidence"):
        np.testing.assert_array_equal(np.asarray(b[what]), np.asarray(a[what]), err_msg=what)
    for k in a["prefill_taps"]:
        np.testing.assert_array_equal(np.asarray(b["prefill_taps"][k]), np.asarray(a["prefill_taps"][k]), err_msg=k)
    for phase in ("after_prefill_cache", "after_decode_cache"):
        for field in ("window", "comp_kv", "index_k"):
            assert len(a[phase][field]) == len(b[phase][field]) > 0
            for i, (x, y) in enumerate(zip(a[phase][field], b[phase][field])):
                np.testing.assert_array_equal(y, x, err_msg=f"{phase} {field}[{i}]")
        # the rings and entries hold real values, not zeros that would match trivially
        assert any(np.abs(w).max() > 0 for w in b[phase]["window"])
        assert any(np.abs(c).max() > 0 for c in b[phase]["comp_kv"])


def test_fp8_index_key_cache_is_bit_identical(golden_dir):
    """``CacheConfig.index_key_dtype="fp8"`` (e5m2 codes + a power-of-two scale per key) stores the
    same keys: a whole golden run (prefill with taps, decode, drafts) is bit-identical to the bf16
    cache's, index selections and decoded index-key caches included."""
    a = run_golden(str(golden_dir), "tiny_fp8")
    b = run_golden(str(golden_dir), "tiny_fp8", index_key_dtype="fp8")
    for what in ("prefill_logits_all", "decode_logits", "dspark_ids", "dspark_logits"):
        np.testing.assert_array_equal(np.asarray(b[what]), np.asarray(a[what]), err_msg=what)
    index_taps = [k for k in a["prefill_taps"] if k.startswith("index")]
    assert index_taps
    for k in index_taps:
        np.testing.assert_array_equal(b["prefill_taps"][k], a["prefill_taps"][k], err_msg=k)
    for phase in ("after_prefill_cache", "after_decode_cache"):
        for i, (x, y) in enumerate(zip(a[phase]["index_k"], b[phase]["index_k"])):
            np.testing.assert_array_equal(y, x, err_msg=f"{phase} index keys of source {i}")
