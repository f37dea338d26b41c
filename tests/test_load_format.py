"""``EngineConfig.load_format="dummy"``: the engine runs on random weights drawn on the device
(``models/random_weights.py``), the model directory supplying only config.json and
tokenizer.json. Same ``model_seed``, same weights and tokens; the weights are not the
checkpoint's; a preset writes no checkpoint; a mesh gets each weight in ``load_model``'s
sharding with the same values; a bad value is refused naming the field."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from cpu_devices import cpu_devices_env
from deepinfer_jax import LLM, SamplingParams
from deepinfer_jax.models.registry import resolve_model

# the CLI's engine sizes (16 rows, 128-token steps): the CLI run below reuses these compiles
ENGINE = dict(max_num_seqs=16, max_num_batched_tokens=128, progress=False)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [[5, 17, 42, 99, 7], [3, 4, 5, 6, 7, 8, 9, 10, 11], [200, 31]]


def tokens(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def leaves(llm):
    return [np.asarray(x) for x in llm.runner.state_leaves]


def same(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.fixture(scope="module")
def tiny_dir():
    return resolve_model("v41-tiny", progress=False)  # the cached random checkpoint (written once)


@pytest.fixture(scope="module")
def dummy(tiny_dir):
    return LLM(tiny_dir, load_format="dummy", model_seed=5, **ENGINE)


def test_dummy_generates_and_same_seed_same_weights(tiny_dir, dummy):
    toks = tokens(dummy)
    assert [len(t) for t in toks] == [6, 6, 6]
    assert all(0 <= i < dummy.model_config.vocab_size for t in toks for i in t)
    again = LLM(tiny_dir, load_format="dummy", model_seed=5, **ENGINE)
    assert all(same(a, b) for a, b in zip(leaves(dummy), leaves(again)))
    assert tokens(again) == toks
    other = LLM(tiny_dir, load_format="dummy", model_seed=6, **ENGINE)
    assert sum(not same(a, b) for a, b in zip(leaves(dummy), leaves(other))) > len(leaves(dummy)) // 2


def test_dummy_weights_are_not_the_checkpoints(tiny_dir, dummy):
    ckpt = LLM(tiny_dir, **ENGINE)  # load_format="auto"
    assert ckpt.engine_config.load_format == "auto" and dummy.engine_config.load_format == "dummy"
    a, b = leaves(ckpt), leaves(dummy)
    assert [(x.shape, x.dtype) for x in a] == [(x.shape, x.dtype) for x in b]
    assert sum(not same(x, y) for x, y in zip(a, b)) > len(a) // 2
    assert dummy.tokenizer is not None  # the directory's tokenizer still serves text prompts
    assert len(dummy.generate("the cat", GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 6


def test_preset_with_dummy_writes_no_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_CACHE", str(tmp_path))
    d = resolve_model("v41-tiny", weights=False)
    assert sorted(os.listdir(d)) == ["config.json", "tokenizer.json", "tokenizer_config.json"]
    assert os.path.basename(d) == "v41-tiny-config"
    full = resolve_model("v41-tiny", progress=False)
    for f in ("config.json", "tokenizer.json"):  # the checkpoint's own config and tokenizer
        with open(os.path.join(d, f)) as x, open(os.path.join(full, f)) as y:
            assert x.read() == y.read(), f


def test_cli_load_format_dummy(tmp_path, monkeypatch, capsys):
    from deepinfer_jax.entrypoints.cli import main

    monkeypatch.setenv("DEEPINFER_CACHE", str(tmp_path))
    assert main(["generate", "--model", "v41-tiny", "--load-format", "dummy", "--prompt-ids", "5,17,42",
                 "--max-tokens", "3", "--ignore-eos", "--no-compile-cache"]) == 0
    assert "(length)" in capsys.readouterr().out
    assert os.listdir(tmp_path) == ["v41-tiny-config"]  # no checkpoint written


@pytest.mark.parametrize("value, why", [("safetensors", "expected one of ('auto', 'dummy')"),
                                        (None, "must be a string")])
def test_bad_load_format_named(tiny_dir, value, why):
    with pytest.raises(ValueError) as ei:
        LLM(tiny_dir, load_format=value, **ENGINE)
    assert str(ei.value).startswith(f"EngineConfig.load_format={value!r}: {why}"), str(ei.value)


def test_sharded_draw_matches_unsharded(tmp_path):
    """On 4 CPU devices (dp=2, cp=2): every weight in ``load_model``'s sharding for the mesh, the
    same values as drawn on one device."""
    code = textwrap.dedent(f"""
        import numpy as np, jax
        from flax import nnx
        from deepinfer_jax.config import preset
        from deepinfer_jax.models.random_weights import random_model_on_device
        from deepinfer_jax.models.weights import abstract_model
        from deepinfer_jax.sharding.mesh import ParallelConfig, make_mesh
        from deepinfer_jax.sharding.partition import flat_shardings, state_shardings

        cfg = preset("v41-tiny")
        mesh = make_mesh(ParallelConfig(dp=2, cp=2))
        want = flat_shardings(state_shardings(abstract_model(cfg)[1], mesh))
        sharded = nnx.to_flat_state(nnx.state(random_model_on_device(cfg, 3, mesh=mesh)))
        one = dict(nnx.to_flat_state(nnx.state(random_model_on_device(cfg, 3))))
        split = 0
        for path, var in sharded:
            x = var.get_value()
            assert x.sharding.is_equivalent_to(want[path], x.ndim), path
            split += x.addressable_shards[0].data.size < x.size
            y = np.asarray(one[path].get_value())
            assert np.array_equal(np.asarray(x).view(np.uint8), y.view(np.uint8)), path
        assert split > 0
        print("OK", len(sharded), split)
    """)
    proc = subprocess.run([sys.executable, "-c", code], env=cpu_devices_env(4), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
