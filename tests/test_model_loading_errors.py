"""``load_model`` refuses a checkpoint that does not match its config (ValueError naming the
tensor), and keeps quantized weights quantized in memory."""

from __future__ import annotations

import json
import os
import shutil

import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from deepinfer_jax.config import preset
from deepinfer_jax.checkpoint.random_checkpoint import write_random_checkpoint
from deepinfer_jax.checkpoint.safetensors_io import INDEX_FILE, open_checkpoint_dir, write_safetensors
from deepinfer_jax.models.weights import load_model


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_good")
    write_random_checkpoint(preset("v41-tiny"), d, seed=3, progress=False)
    return d


def rewrite(good_dir, out_dir, mutate=None, keep_index: bool = False):
    """Copy ``good_dir`` to ``out_dir`` with all tensors in one ``model.safetensors`` after
    ``mutate(tensors, dtypes)`` (file dtype strings; edit both)."""
    shutil.copytree(good_dir, out_dir)
    r = open_checkpoint_dir(out_dir)
    tensors = {n: np.array(r.get(n)) for n in r.keys()}
    dtypes = {n: r.spec(n)[0] for n in r.keys()}
    shards = r.files
    r.close()
    for f in shards:
        os.remove(os.path.join(out_dir, os.path.basename(f)))
    if mutate is not None:
        mutate(tensors, dtypes)
    write_safetensors(os.path.join(out_dir, "model.safetensors"), tensors, dtypes)
    idx = os.path.join(out_dir, INDEX_FILE)
    if keep_index:
        with open(idx) as fh:
            index = json.load(fh)
        index["weight_map"] = {n: "model.safetensors" for n in index["weight_map"]}
        with open(idx, "w") as fh:
            json.dump(index, fh)
    else:
        os.remove(idx)
    return out_dir


def load_error(path) -> str:
    with pytest.raises(ValueError) as ei:
        load_model(path)
    return str(ei.value)


def test_rewritten_copy_still_loads(good_dir, tmp_path):
    """The rewrite helper alone breaks nothing (so the failures below are the mutations')."""
    model = load_model(rewrite(good_dir, tmp_path / "ok"))
    ref = open_checkpoint_dir(good_dir)
    w = model.layers[2].attn.wq_a.weight[...]
    np.testing.assert_array_equal(np.asarray(w).view(np.uint8),
                                  np.asarray(ref.get("layers.2.attn.wq_a.weight")).view(np.uint8))


@pytest.mark.parametrize("name", [
    "layers.2.attn.wq_a.weight",
    "layers.2.attn.wq_a.scale",
    "layers.1.ffn.experts.5.w1.weight",
    "layers.3.attn.indexer.wk.weight",
    "mtp.1.markov_head.head.weight",
])
def test_missing_tensor(good_dir, tmp_path, name):
    def drop(t, d):
        del t[name], d[name]
    msg = load_error(rewrite(good_dir, tmp_path / "c", drop))
    assert name in msg and "missing" in msg, msg


@pytest.mark.parametrize("name", ["layers.0.attn.bogus.weight", "layers.0.ffn.experts.8.w1.weight"])
def test_extra_tensor(good_dir, tmp_path, name):
    def add(t, d):
        t[name] = np.zeros((4, 4), ml_dtypes.bfloat16)
        d[name] = "BF16"
    msg = load_error(rewrite(good_dir, tmp_path / "c", add))
    assert name in msg and "unexpected" in msg, msg


def test_extra_tensor_not_in_index(good_dir, tmp_path):
    name = "layers.0.attn.bogus.weight"

    def add(t, d):
        t[name] = np.zeros((4, 4), ml_dtypes.bfloat16)
        d[name] = "BF16"
    msg = load_error(rewrite(good_dir, tmp_path / "c", add, keep_index=True))
    assert name in msg, msg


@pytest.mark.parametrize("name", [
    "layers.0.attn.wkv.weight",            # fp8 dense
    "layers.0.attn.wkv.scale",             # its ue8m0 scales
    "layers.4.ffn.experts.0.w2.weight",    # fp4-packed expert
    "embed.weight",
])
def test_wrong_shape(good_dir, tmp_path, name):
    def reshape(t, d):
        a = t[name]
        t[name] = np.zeros((a.shape[0] + 1,) + a.shape[1:], a.dtype)
    msg = load_error(rewrite(good_dir, tmp_path / "c", reshape))
    assert name in msg and "shape" in msg, msg


@pytest.mark.parametrize("name, new_dtype, want, found", [
    ("layers.0.attn.wq_a.weight", ml_dtypes.bfloat16, "F8_E4M3", "BF16"),   # bf16 where fp8 expected
    ("layers.0.attn.wq_a.scale", np.float32, "F8_E8M0", "F32"),             # f32 scales
    ("layers.2.ffn.experts.3.w3.weight", ml_dtypes.float8_e4m3fn, "I8", "F8_E4M3"),  # fp8 for fp4
    ("layers.0.attn.attn_sink", ml_dtypes.bfloat16, "F32", "BF16"),
])
def test_wrong_dtype(good_dir, tmp_path, name, new_dtype, want, found):
    def retype(t, d):
        t[name] = np.zeros(t[name].shape, new_dtype)
        d[name] = found
    msg = load_error(rewrite(good_dir, tmp_path / "c", retype))
    assert name in msg and "dtype" in msg and want in msg and found in msg, msg


def test_uint8_expert_bytes_as_u8(good_dir, tmp_path):
    """fp4 expert codes must be I8 in the file; the same bytes labelled U8 are refused."""
    name = "layers.1.ffn.experts.0.w1.weight"

    def relabel(t, d):
        d[name] = "U8"
    msg = load_error(rewrite(good_dir, tmp_path / "c", relabel))
    assert name in msg and "U8" in msg, msg


def test_several_problems_are_all_listed(good_dir, tmp_path):
    a, b = "layers.5.attn.wo_b.weight", "head.weight"

    def both(t, d):
        del t[a], d[a]
        t[b] = t[b][:-1]
    msg = load_error(rewrite(good_dir, tmp_path / "c", both))
    assert a in msg and b in msg, msg


# ----------------------------------------------------------------------------- non-finite weights


def _set_bits(t, name, flat_index, value, view):
    a = np.array(t[name])
    a.reshape(-1).view(view)[flat_index] = value
    t[name] = a


@pytest.mark.parametrize("name, index, value, view", [
    ("embed.weight", 1234, 0x7FC0, np.uint16),                   # bf16 NaN in the embedding
    ("embed.weight", 7, 0xFF80, np.uint16),                      # bf16 -Inf
    ("layers.0.attn.attn_sink", 1, 0x7F800000, np.uint32),       # f32 +Inf
    ("layers.2.attn.wq_a.scale", 3, 0xFF, np.uint8),             # ue8m0 0xFF is NaN
    ("layers.1.ffn.experts.6.w2.scale", 0, 0xFF, np.uint8),      # an expert's scale (stacked on load)
    ("layers.3.attn.wkv.weight", 10, 0x7F, np.uint8),            # fp8 e4m3fn NaN
    ("mtp.1.markov_head.embed.weight", 5, 0x7FC0, np.uint16),    # DSpark Markov head
])
def test_non_finite_weight_is_refused(good_dir, tmp_path, name, index, value, view):
    msg = load_error(rewrite(good_dir, tmp_path / "c", lambda t, d: _set_bits(t, name, index, value, view)))
    assert f"tensor {name} " in msg and "non-finite" in msg, msg


def test_largest_finite_values_load(good_dir, tmp_path):
    """Not over-eager: the largest finite bf16 / fp8 / ue8m0 (0xFE) values load."""
    def extremes(t, d):
        _set_bits(t, "embed.weight", 0, 0x7F7F, np.uint16)               # bf16 max
        _set_bits(t, "layers.3.attn.wkv.weight", 0, 0x7E, np.uint8)      # e4m3fn 448
        _set_bits(t, "layers.2.attn.wq_a.scale", 0, 0xFE, np.uint8)      # 2^127
    load_model(rewrite(good_dir, tmp_path / "c", extremes))


def test_nonfinite_counts_across_chunks(monkeypatch):
    from deepinfer_jax.checkpoint import finite_check

    monkeypatch.setattr(finite_check, "CHUNK", 8)
    a = np.zeros((5, 7), ml_dtypes.bfloat16)
    assert finite_check.nonfinite(a, "BF16") == (0, -1)
    a[3, 2], a[4, 6] = np.inf, np.nan
    assert finite_check.nonfinite(a, "BF16") == (2, 23)
    with pytest.raises(ValueError, match=r"tensor w \(BF16 \[5, 7\]\): 2 non-finite.*index \(3, 2\)"):
        finite_check.check_finite("w", a, "BF16")
    assert finite_check.nonfinite(np.full(9, -1, np.int8), "I8") == (0, -1)  # fp4 codes: no NaN


# ----------------------------------------------------------------------------- quantized stays quantized


def test_golden_fp8_loads_quantized(golden_dir):
    d = golden_dir / "tiny_fp8"
    model = load_model(d)
    a = model.layers[0].attn
    assert a.wq_a.weight[...].dtype == np.dtype(ml_dtypes.float8_e4m3fn)
    assert a.wq_a.scale[...].dtype == np.uint8                      # ue8m0 exponent bytes
    assert a.wq_a.weight[...].shape == (64, 128) and a.wq_a.scale[...].shape == (2, 4)
    e = model.layers[0].ffn.experts
    assert e.w1.weight[...].dtype == np.uint8                       # fp4 e2m1, two per byte
    assert e.w1.weight[...].shape == (8, 64, 128 // 2)              # [E, inter, hidden/2]
    assert e.w1.scale[...].dtype == np.uint8 and e.w1.scale[...].shape == (8, 64, 128 // 32)
    # bytes in memory are the file's bytes
    r = open_checkpoint_dir(d)
    np.testing.assert_array_equal(np.asarray(a.wq_a.weight[...]).view(np.uint8),
                                  np.asarray(r.get("layers.0.attn.wq_a.weight")).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(e.w1.weight[...][5]).view(np.int8),
                                  np.asarray(r.get("layers.0.ffn.experts.5.w1.weight")))
    # nothing was dequantized: the parameters hold exactly as many bytes as the file's tensors
    leaves = [v.get_value() for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param))]
    assert sum(np.asarray(x).nbytes for x in leaves) == sum(r.get(n).nbytes for n in r.keys())


def test_golden_bf16_loads(golden_dir):
    model = load_model(golden_dir / "tiny_bf16")
    assert model.layers[0].attn.wq_a.weight[...].dtype == np.dtype(ml_dtypes.bfloat16)
    assert model.layers[0].ffn.experts.w1.weight[...].shape == (8, 64, 128)
    assert not hasattr(model.layers[0].attn.wq_a, "scale")


def test_single_routed_expert_loads(tmp_path):
    """One routed expert is still a stack [1, ...] (found by test_generality: its one file tensor
    was read as the whole parameter and refused for its shape)."""
    cfg = preset("v41-tiny").replace(n_routed_experts=1, num_experts_per_tok=1, dspark_n_routed_experts=1,
                                     dspark_num_experts_per_tok=1)
    write_random_checkpoint(cfg, tmp_path, seed=1, progress=False)
    model = load_model(tmp_path)
    r = open_checkpoint_dir(tmp_path)
    w1 = model.layers[0].ffn.experts.w1
    assert w1.weight[...].shape == (1, 64, 128 // 2) and w1.scale[...].shape == (1, 64, 128 // 32)
    np.testing.assert_array_equal(np.asarray(w1.weight[...][0]).view(np.int8),
                                  np.asarray(r.get("layers.0.ffn.experts.0.w1.weight")))
