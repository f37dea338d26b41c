"""``scripts/bench_train_step.py``: the shape recorder finds every op call of the training
forward (with its layers and call counts), and a tiny in-process run writes a JSON with one
timed row per op signature plus the LM head / CE / indexer-KL rows (whole step skipped: its
compile is what tests/test_training.py already pays); a spent budget skips rows but still
writes the file."""

from __future__ import annotations

import json

import pytest

from conftest import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_train_step")


def test_recorder_sees_every_op_call(bench):
    from deepinfer_jax.kernels_pallas import ops
    from deepinfer_jax.training.presets import train_config

    cfg = train_config("v41-train-tiny")
    assert {"sparse_attention", "indexer_scores_pool", "candidate_blocks", "topk_positions", "moe_experts",
            "sinkhorn_iterate"} <= set(bench.public_ops(ops))
    calls, extras = bench.record_forward(cfg, 2, 16)
    by_op = {}
    for c in calls:
        by_op.setdefault(c.op, []).append(c)
    n_layers = cfg.num_hidden_layers
    assert sum(c.calls for c in by_op["sparse_attention"]) == n_layers
    assert len(by_op["sparse_attention"]) == 3  # ratio 0, 2 and 1 layers have distinct shapes
    assert sum(c.calls for c in by_op["moe_experts"]) == n_layers
    assert sum(c.calls for c in by_op["sinkhorn_iterate"]) == 2 * n_layers
    assert sorted(l for c in by_op["sparse_attention"] for l in c.layers) == list(range(n_layers))
    assert getattr(ops, "sparse_attention").__name__ == "sparse_attention"  # unpatched afterwards
    assert extras["head"]["h"].shape == (2 * 16, cfg.hidden_size)
    assert set(extras["taps"]) == {f"{k}{l}_{s}" for l in cfg.index_source_layer_ids
                                   for k, s in (("attn", "q"), ("index", "scores"))}


def test_tiny_run_writes_op_rows(bench, tmp_path):
    out = tmp_path / "r.json"
    assert bench.main(["--preset", "v41-train-tiny", "--batch", "1", "--seq-len", "32", "--skip-step",
                       "--reps", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["complete"] and res["step"] is None
    names = [r["name"] for r in res["ops"]]
    for want in ("sparse_attention r0", "sparse_attention r2", "sparse_attention r1", "indexer_scores_pool",
                 "candidate_blocks", "topk_positions", "moe_experts", "sinkhorn_iterate",
                 "lm_head(f32)+cross_entropy", "indexer_kl"):
        assert any(n.startswith(want) for n in names), (want, names)
    for r in res["ops"]:
        assert "error" not in r, r
        assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["calls"] >= 1
    assert res["summary"]["op_sum_ms"] > 0

    out0 = tmp_path / "r0.json"
    assert bench.main(["--preset", "v41-train-tiny", "--batch", "1", "--seq-len", "16", "--budget-s", "0",
                       "--out", str(out0)]) == 0
    res0 = json.loads(out0.read_text())
    assert res0["ops"] and all(r.get("skipped") == "budget" for r in res0["ops"])
    assert res0["step"] == {"skipped": "budget"}
