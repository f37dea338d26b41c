"""DSpark training data written by the target (``runner/regenerate.py``), its windows
(``TokenBatches(aligned=True)``, anchors after the prompt) and the exact bf16 copy of a quantized
checkpoint (``checkpoint/dequantize.py``) the stages train on. v41-tiny, random weights."""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest

from deepinfer_jax.checkpoint.dequantize import dequantize_checkpoint
from deepinfer_jax.checkpoint.quant_formats import dequantize_fp4, dequantize_fp8_block, quantize_fp8_block
from deepinfer_jax.checkpoint.random_checkpoint import write_random_checkpoint
from deepinfer_jax.checkpoint.safetensors_io import open_checkpoint_dir
from deepinfer_jax.checkpoint.spec import checkpoint_spec, scale_name
from deepinfer_jax.config import ModelConfig, preset
from deepinfer_jax.models.weights import load_model
from deepinfer_jax.runner.engram_hash import EngramHasher
from deepinfer_jax.runner.sequence_driver import SequenceDriver
from deepinfer_jax.runner.spec_acceptance import acceptance_cache_config
from deepinfer_jax.training.data import TokenBatches
from deepinfer_jax.training.dspark_forward import sample_anchors
from deepinfer_jax.runner.regenerate import continue_prompts, prompt_windows

P, NEW = 12, 10


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("v41_tiny_regen")
    write_random_checkpoint(preset("v41-tiny"), d, seed=3, progress=False)
    model = load_model(d)
    return d, model, EngramHasher.from_model_config(model.cfg, os.path.join(d, "tokenizer.json"))


@pytest.fixture(scope="module")
def prompts():
    return np.random.default_rng(11).integers(4, 250, size=(4, P)).astype(np.int32)


def test_greedy_continuations_are_the_models_greedy_decoding(tiny, prompts):
    """Four prompts in groups of 3 slots (a short last group): each continuation equals decoding
    that prompt alone, token by token (the window ring of 8 wraps inside the prompt). Every step
    of both runs is padded to shapes the other tests share (3 rows; 3 * P tokens): few compiles."""
    _, model, hasher = tiny
    out = continue_prompts(model, prompts, NEW, batch_size=3, hasher=hasher, prefill_rows=3)
    assert out.shape == (4, P + NEW) and out.dtype == np.int32
    np.testing.assert_array_equal(out[:, :P], prompts)
    cc = acceptance_cache_config(model.cfg, 1, P + NEW)
    for i, p in enumerate(prompts):
        ref = SequenceDriver(model, cc, hasher).generate_greedy(p.tolist(), NEW, num_tokens=3 * P, num_rows=3)
        assert out[i, P:].tolist() == ref, f"prompt {i}"


def test_sampled_continuations_are_seeded_and_avoid_banned_ids(tiny, prompts):
    _, model, hasher = tiny
    V = model.cfg.vocab_size
    banned = [i for i in range(V) if i % 7]  # only multiples of 7 may be sampled
    kw = dict(batch_size=3, temperature=1.0, hasher=hasher, banned_ids=banned, prefill_rows=3)
    a = continue_prompts(model, prompts, NEW, seed=5, **kw)
    b = continue_prompts(model, prompts, NEW, seed=5, **kw)
    c = continue_prompts(model, prompts, NEW, seed=6, **kw)
    np.testing.assert_array_equal(a, b)
    assert (a[:, P:] != c[:, P:]).any()
    assert np.all(a[:, P:] % 7 == 0)


def test_prompt_windows():
    docs = [np.arange(100, 105), np.arange(1000, 1040), np.arange(2000, 2003)]
    w = prompt_windows(docs, 50, 8, seed=1)
    assert w.shape == (50, 8) and w.dtype == np.int32
    np.testing.assert_array_equal(np.diff(w, axis=1), 1)  # a contiguous slice of one document
    assert np.all((w[:, 0] >= 1000) & (w[:, -1] < 1040))  # the only document with 8 tokens
    np.testing.assert_array_equal(w, prompt_windows(docs, 50, 8, seed=1))
    with pytest.raises(ValueError, match="no document has 41 tokens"):
        prompt_windows(docs, 5, 41)


def test_aligned_windows_are_whole_sequences():
    seqs = np.repeat(np.arange(6)[:, None], 16, axis=1) * 10 + np.arange(16)  # sequence k: 10k .. 10k+15
    tb = TokenBatches(seqs.reshape(-1), batch=32, seq_len=16, seed=0, aligned=True)
    for i in range(3):
        b = tb(i)
        np.testing.assert_array_equal(b - b[:, :1], np.arange(16)[None].repeat(32, 0))
        assert set(b[:, 0] % 10) == {0}
    with pytest.raises(ValueError, match="multiple of seq_len=16"):
        TokenBatches(seqs.reshape(-1)[:-1], batch=2, seq_len=16, aligned=True)


def test_anchor_low_keeps_blocks_out_of_the_prompt():
    a = sample_anchors([0, 1], 64, 40, 16, low=30)
    assert a.min() == 30 and a.max() == 38
    with pytest.raises(ValueError, match="anchor low=39"):
        sample_anchors(0, 2, 40, 4, low=39)


def test_dequantized_copy_holds_the_quantized_weights_exactly(tiny, tmp_path):
    src, model, _ = tiny
    cfg = ModelConfig.from_json(src)
    assert cfg.weight_dtype == "fp8" and cfg.expert_dtype == "fp4"
    out = dequantize_checkpoint(src, tmp_path / "bf16")
    ocfg = ModelConfig.from_json(out)
    assert (ocfg.weight_dtype, ocfg.expert_dtype) == ("bf16", "bf16")
    assert os.path.isfile(os.path.join(out, "tokenizer.json"))
    spec = checkpoint_spec(cfg)
    n_fp8 = n_fp4 = 0
    with open_checkpoint_dir(src) as r, open_checkpoint_dir(out) as o:
        assert sorted(o.keys()) == sorted(checkpoint_spec(ocfg))
        for name, s in spec.items():
            if s.kind in ("fp8_linear", "fp4_linear"):
                deq = (dequantize_fp8_block if s.kind == "fp8_linear" else dequantize_fp4)(
                    r.get(name), r.get(scale_name(name)), 32)
                got = o.get(name)
                assert got.dtype == ml_dtypes.bfloat16
                np.testing.assert_array_equal(got.astype(np.float32), deq, err_msg=name)
                if s.kind == "fp8_linear":  # quantizing the copy again gives the same values
                    q, sc = quantize_fp8_block(got.astype(np.float32), 32)
                    np.testing.assert_array_equal(dequantize_fp8_block(q, sc, 32), deq, err_msg=name)
                n_fp8 += s.kind == "fp8_linear"
                n_fp4 += s.kind == "fp4_linear"
            elif not s.is_scale:
                np.testing.assert_array_equal(o.get(name), r.get(name), err_msg=name)
    assert n_fp8 > 10 and n_fp4 > 10
    # the loaded bf16 model holds the fp8 model's dequantized weights
    m16 = load_model(out)
    w8 = model.layers[0].attn.wq_a.dequantized()
    w16 = m16.layers[0].attn.wq_a.weight[...]
    np.testing.assert_array_equal(np.asarray(w16, np.float32), np.asarray(w8, np.float32))
    with pytest.raises(ValueError, match="is the source directory"):
        dequantize_checkpoint(out, out)


def test_train_split_is_the_training_files_in_the_models_tokenizer(tmp_path):
    """``regenerate_data.py --sequences 0 --train-split --heldout``: train.npy holds exactly the
    training split's files (encoded with the model's tokenizer, each ending in EOS) and no
    held-out file; nothing is generated."""
    import importlib.util

    import tokenizers

    from deepinfer_jax.models.registry import DEFAULT_MODEL, SHIPPED
    from deepinfer_jax.training import corpus_files, corpus_split, token_files

    root = tmp_path / "src"
    root.mkdir()
    for i in range(24):
        (root / f"mod_{i}.py").write_text(f"def f{i}(x):\n    return x * {i} + {i * i}  # module {i}\n")
    spec = importlib.util.spec_from_file_location(
        "regenerate_data", os.path.join(os.path.dirname(__file__), "..", "scripts", "train", "regenerate_data.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "out"
    assert script.main(["--out", str(out), "--roots", str(root), "--sequences", "0", "--train-split", "--heldout",
                        "--heldout-fraction", "0.3", "--no-progress"]) == 0
    assert not (out / "regen.npy").exists()
    files, _, _ = corpus_files.collect_files(corpus_files.unique_roots([str(root)]), progress=False)
    train, heldout = corpus_split.split_files(files, 0.3, corpus_split.DEFAULT_SALT)
    assert train and heldout
    model_dir = os.fspath(SHIPPED[DEFAULT_MODEL])
    tok = tokenizers.Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    eos = ModelConfig.from_json(model_dir).eos_token_id
    got = np.load(out / "train.npy", mmap_mode="r")
    np.testing.assert_array_equal(got, token_files.encode_documents(tok, [f.text for f in train], eos))
    assert int(np.sum(np.asarray(got) == eos)) == len(train)
    np.testing.assert_array_equal(np.load(out / "heldout.npy", mmap_mode="r"),
                                  token_files.encode_documents(tok, [f.text for f in heldout], eos))
