"""The paged-block size follows the model: ``EngineConfig.block_tokens`` defaults to a size every
compress ratio and candidate block divides (near 64 positions), and a size that does not fit is
refused naming the field, the value and the nearest sizes that do."""

from __future__ import annotations

import pytest

from deepinfer_jax.config import preset
from deepinfer_jax.engine_config import EngineConfig
from deepinfer_jax.models.cache import CacheConfig, default_block_tokens


def tiny_with_candidate_block(size: int):
    return preset("v41-tiny").replace(candidate_block_size=size)  # candidate source has ratio 1


@pytest.mark.parametrize("size, want", [(4, 64), (5, 60), (3, 66), (7, 70), (8, 64)])
def test_default_block_tokens_fits_the_model(size, want):
    cfg = tiny_with_candidate_block(size)  # ratios 1 and 2: unit lcm(2, size)
    ec = EngineConfig().resolve(cfg, "cpu")
    assert ec.block_tokens == want
    CacheConfig(num_blocks=ec.num_blocks, block_tokens=ec.block_tokens,
                max_blocks_per_seq=ec.blocks_per_seq).validate(cfg)


def test_default_block_tokens_with_ratio_4_candidates():
    cfg = preset("v41-tiny").replace(compress_ratios=(0, 2, 2, 4, 4, 4, 0, 0), candidate_block_size=7)
    assert default_block_tokens(cfg) == 56  # multiple of 4 * 7 = 28 nearest 64
    assert EngineConfig().resolve(cfg).block_tokens == 56


def test_no_compressed_layers_keeps_64():
    cfg = preset("v41-tiny").replace(compress_ratios=(0,) * 8, kv_source_layer_ids=(), index_source_layer_ids=(),
                                     candidate_source_layer_id=-1)
    assert EngineConfig().resolve(cfg).block_tokens == 64


def test_user_block_tokens_that_does_not_fit_names_nearest():
    cfg = tiny_with_candidate_block(5)
    with pytest.raises(ValueError) as ei:
        EngineConfig(block_tokens=64).resolve(cfg)
    msg = str(ei.value)
    assert "EngineConfig.block_tokens=64" in msg and "60 or 70" in msg and "candidate_block_size 5" in msg, msg
    with pytest.raises(ValueError, match=r"EngineConfig.block_tokens=4: .*nearest that fit: 10\b"):
        EngineConfig(block_tokens=4).resolve(cfg)
    with pytest.raises(ValueError, match=r"CacheConfig.block_tokens=64: .*60 or 70"):
        CacheConfig(block_tokens=64).validate(cfg)
    assert EngineConfig(block_tokens=30).resolve(cfg).block_tokens == 30


@pytest.mark.parametrize("bad", [0, -8, 6.0, "64"])
def test_block_tokens_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match=rf"EngineConfig.block_tokens={bad!r}"):
        EngineConfig(block_tokens=bad).resolve(preset("v41-tiny"))
