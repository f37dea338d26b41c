"""safetensors model dir -> Orbax model dir (via the ``convert`` CLI piece) -> load: every
parameter bit-identical (fp8 / uint8 storage included) and an identical forward."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
from flax import nnx

from deepinfer_jax.config import ModelConfig, preset
from deepinfer_jax.models.cache import CacheConfig
from deepinfer_jax.runner.sequence_driver import SequenceDriver
from deepinfer_jax.checkpoint.random_checkpoint import write_random_checkpoint

# same step shapes as tests/test_sharding.py, so one session compiles the step once
CACHE = CacheConfig(num_slots=2, num_blocks=8, block_tokens=32, max_blocks_per_seq=4)
NUM_TOKENS = 24


def _convert_cli(src, dst, *extra):
    from deepinfer_jax.entrypoints import convert_cmd

    parser = argparse.ArgumentParser(prog="deepinfer-jax")
    sub = parser.add_subparsers(dest="command", required=True)
    convert_cmd.add_parser(sub)
    args = parser.parse_args(["convert", "--model", str(src), "--out", str(dst), "--no-progress", *extra])
    assert args.func is convert_cmd.run
    return convert_cmd.run(args)


def _flat(model):
    return {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model))}


def _prefill(model):
    drv = SequenceDriver(model, CACHE)
    rng = np.random.default_rng(5)
    lg, _, _ = drv.step([(0, rng.integers(3, 250, 7).tolist()), (1, rng.integers(3, 250, 4).tolist())],
                        num_tokens=NUM_TOKENS, logits="last")
    return lg


def test_convert_roundtrip(tmp_path):
    from deepinfer_jax.checkpoint.orbax_io import is_orbax_dir, save_orbax
    from deepinfer_jax.models.weights import load_orbax
    from deepinfer_jax.models.weights import load_model

    src, dst = tmp_path / "st", tmp_path / "orbax"
    write_random_checkpoint(preset("v41-tiny"), src, seed=11, progress=False)
    assert _convert_cli(src, dst) == 0
    assert is_orbax_dir(dst) and not is_orbax_dir(src)
    assert (dst / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    assert ModelConfig.from_json(dst) == ModelConfig.from_json(src)
    json.loads((dst / "config.json").read_text())

    ref = load_model(src)
    got = load_model(dst)  # the Orbax branch of load_model
    a, b = _flat(ref), _flat(got)
    assert a.keys() == b.keys()
    for name in a:
        x, y = np.asarray(a[name]), np.asarray(b[name])
        assert x.dtype == y.dtype and x.shape == y.shape, (name, x.dtype, y.dtype, x.shape, y.shape)
        assert x.tobytes() == y.tobytes(), name
    dtypes = {str(np.asarray(v).dtype) for v in a.values()}
    assert {"float8_e4m3fn", "uint8", "bfloat16", "float32"} <= dtypes, dtypes
    # NNX metadata (logical axes) comes from the model, not the checkpoint
    st = dict(nnx.to_flat_state(nnx.state(got)))
    assert st[("layers", 0, "ffn", "experts", "w1", "weight")].get_metadata()["logical_axes"][0] == "expert"

    np.testing.assert_array_equal(_prefill(got), _prefill(ref))

    # a config that does not match the saved arrays is refused (orbax alone would pad/truncate)
    with pytest.raises(ValueError, match="mismatched"):
        load_orbax(dst, cfg=ModelConfig.from_json(dst).replace(vocab_size=512))

    # writing again needs force; load_orbax directly gives the same arrays
    with pytest.raises(FileExistsError):
        save_orbax(got, dst)
    save_orbax(got, dst, force=True)
    again = _flat(load_orbax(dst))
    assert all(np.asarray(again[k]).tobytes() == np.asarray(a[k]).tobytes() for k in a)
