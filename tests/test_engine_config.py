"""``EngineConfig.resolve`` checks the type and range of every field; the error names the field
and the bad value (no raw TypeError from deep inside, no bad value taken as another)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from deepinfer_jax.config import preset
from deepinfer_jax.engine_config import _FIELD_TYPES, EngineConfig

CFG = preset("v41-tiny")


@pytest.mark.parametrize("field, value, why", [
    ("async_scheduling", "no", "must be a bool"),
    ("enable_prefix_caching", "no", "must be a bool"),
    ("precompile", 1, "must be a bool"),
    ("max_num_seqs", True, "must be an int"),
    ("max_num_batched_tokens", 64.0, "must be an int"),
    ("max_backtracking_tokens", -1, "must be >= 0"),
    ("yoco_keep_tokens", "140", "must be an int"),
    ("max_logprobs", 10**6, "must be <= the model's vocab_size (256)"),
    ("max_logprobs", -1, "must be >= 0"),
    ("seed", 1.5, "must be an int"),
    ("seed", "x", "must be an int"),
    ("seed", -3, "must be >= 0"),
    ("max_model_len", "256", "must be an int or None"),
    ("num_blocks", 0, "must be >= 1"),
    ("block_tokens", "64", "must be an int"),
    ("prefix_replay_tokens", 2.5, "must be an int or None"),
    ("token_buckets", (64, "128"), "must be a non-empty tuple of ints >= 1"),
    ("token_buckets", (64.5,), "must be a non-empty tuple of ints >= 1"),
    ("token_buckets", (), "must be a non-empty tuple of ints >= 1"),
    ("token_buckets", 64, "must be a non-empty tuple of ints >= 1"),
    ("row_buckets", (True, 16), "must be a non-empty tuple of ints >= 1"),
    ("decoder_buckets", (0, 64), "must be a non-empty tuple of ints >= 1"),
    ("kernels", 3, "must be a string or None"),
    ("index_key_dtype", None, "must be a string"),
    ("yoco_truncation", ["off"], "must be a string"),
    ("dp", 0, "must be >= 1"),
    ("cp", 2.0, "must be an int"),
    ("max_num_seqs", np.int64(4), "must be an int"),
    ("compile_workers", 0, "must be >= 1"),
    ("compile_workers", 2.0, "must be an int or None"),
    ("load_format", "safetensors", "expected one of ('auto', 'dummy')"),
    ("load_format", None, "must be a string"),
])
def test_bad_field_named(field, value, why):
    with pytest.raises(ValueError) as ei:
        EngineConfig(**{field: value}).resolve(CFG)
    assert str(ei.value).startswith(f"EngineConfig.{field}={value!r}: {why}"), str(ei.value)


def test_every_field_is_type_checked():
    assert set(_FIELD_TYPES) == {f.name for f in dataclasses.fields(EngineConfig)}


def test_good_values_still_resolve():
    ec = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, token_buckets=[32, 64],
                      row_buckets=(2, 4), max_model_len=256, max_logprobs=256, seed=2**40).resolve(CFG)
    assert ec.token_buckets == (32, 64) and ec.row_buckets == (2, 4) and ec.max_model_len == 256


def test_dispatch_thread_default_follows_the_platform():
    """Unset, the jitted calls go to the launcher thread on an accelerator (where launching the
    step's kernels is worth overlapping) and stay on the engine's thread on CPU; a given value
    is kept on either; a non-bool is refused by name."""
    assert EngineConfig().resolve(CFG, "gpu").dispatch_thread is True
    assert EngineConfig().resolve(CFG, "tpu").dispatch_thread is True
    assert EngineConfig().resolve(CFG, "cpu").dispatch_thread is False
    assert EngineConfig().resolve(CFG).dispatch_thread is False
    assert EngineConfig(dispatch_thread=False).resolve(CFG, "gpu").dispatch_thread is False
    assert EngineConfig(dispatch_thread=True).resolve(CFG, "cpu").dispatch_thread is True
    with pytest.raises(ValueError, match=r"^EngineConfig\.dispatch_thread='yes': must be a bool \(True or False\) or None"):
        EngineConfig(dispatch_thread="yes").resolve(CFG)
