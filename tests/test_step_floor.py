"""``scripts/step_floor.py``: the byte and FLOP floors ``bench_e2e.py`` reports scale with the
step as they must (no compile: the model's abstract parameters only)."""

from __future__ import annotations

import pytest

from conftest import load_script


@pytest.fixture(scope="module")
def floor():
    return load_script("step_floor")


@pytest.fixture(scope="module")
def tiny(floor):
    from deepinfer_jax.config import preset

    cfg = preset("v41-tiny")
    return cfg, floor.params_of(cfg)


def test_weights_are_read_once_and_the_cache_per_request(floor, tiny):
    cfg, params = tiny
    one = floor.step_floor(cfg, params, floor.StepShape(rows=128, tokens=1, end=300, logit_rows=128))
    two = floor.step_floor(cfg, params, floor.StepShape(rows=256, tokens=1, end=300, logit_rows=256))
    for part in ("window_kv", "compressed_kv", "index_keys"):
        assert one["parts"][part] > 0
        assert two["parts"][part] == pytest.approx(2 * one["parts"][part])
    # at 128 tokens every routed expert and every Engram table row (6 lookups a token) is read
    # already; only the embedding rows grow (bf16 rows of the 256-token vocabulary)
    assert two["parts"]["weights"] - one["parts"]["weights"] == pytest.approx(128 * cfg.hidden_size * 2)


def test_dspark_stages_and_unread_rows_are_not_counted(floor, tiny):
    cfg, params = tiny
    f = floor.step_floor(cfg, params, floor.StepShape(rows=1, tokens=1, end=10, logit_rows=1))
    main = [(n, s, d) for n, s, d in params if not n.startswith("mtp.")]
    all_main = sum(floor._nbytes(s, d) for n, s, d in main)
    table = sum(floor._nbytes(s, d) for n, s, d in main if n == "embed.weight" or ".engram.embed." in n)
    assert f["parts"]["weights"] < all_main - 0.9 * table  # one token reads a few table rows, not the tables
    assert f["parts"]["weights"] < sum(floor._nbytes(s, d) for n, s, d in params)


def test_verification_rows_multiply_the_matmuls_and_the_head(floor, tiny):
    cfg, params = tiny
    d1 = floor.step_floor(cfg, params, floor.StepShape(rows=32, tokens=1, end=500, logit_rows=32))
    d4 = floor.step_floor(cfg, params, floor.StepShape(rows=32, tokens=4, end=500, logit_rows=128))
    assert d4["flop_parts"]["matmul"] == pytest.approx(4 * d1["flop_parts"]["matmul"], rel=0.01)
    # the window is shared by a row's tokens: 3 more entries a row, not 4x
    extra = d4["parts"]["window_kv"] - d1["parts"]["window_kv"]
    assert extra == pytest.approx(32 * 3 * cfg.head_dim * 2 * cfg.num_hidden_layers)


def test_prefill_reads_no_cache_and_is_flop_heavy(floor, tiny):
    cfg, params = tiny
    p = floor.step_floor(cfg, params, floor.StepShape(rows=1, tokens=512, end=512, logit_rows=1, prefill=True))
    assert p["parts"]["window_kv"] == p["parts"]["compressed_kv"] == p["parts"]["index_keys"] == 0
    assert p["flop_parts"]["attention"] > 0 and p["flop_parts"]["indexer"] > 0


def test_packed_caches_count_their_bytes(floor, tiny):
    """The cache parts follow the stored format: packed window entries A + A/32 bytes, packed
    compressed entries A/2 + A/16, fp8 index keys J + 4 (bf16: 2 bytes an element)."""
    cfg, params = tiny
    shape = dict(rows=64, tokens=1, end=400, logit_rows=64)
    plain = floor.step_floor(cfg, params, floor.StepShape(**shape))
    packed = floor.step_floor(cfg, params, floor.StepShape(**shape, **floor.StepShape.cache_bytes("packed", "fp8", cfg.index_head_dim)))
    A, J = cfg.head_dim, cfg.index_head_dim
    ratios = {"window_kv": (A + A / 32) / (2 * A), "compressed_kv": (A / 2 + A / 16) / (2 * A),
              "index_keys": (J + 4) / (2 * J)}
    for part, r in ratios.items():
        assert packed["parts"][part] == pytest.approx(r * plain["parts"][part]), part
    assert packed["parts"]["weights"] == plain["parts"]["weights"]
