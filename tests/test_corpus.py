"""Tests for the corpus preparation of deepinfer_jax.training (corpus_files, corpus_split,
bpe_tokenizer, token_files, compression_baseline, corpus) and scripts/train/prepare_corpus.py,
on a tiny synthetic source tree written in a tmp dir. CPU only, no JAX."""

from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import json
import lzma
import random
import shutil
from pathlib import Path

import numpy as np
import pytest

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.tokenizer import load_tokenizer
from deepinfer_jax.training import bpe_tokenizer as B
from deepinfer_jax.training import compression_baseline, corpus_files, corpus_split, token_files
from deepinfer_jax.training.corpus import prepare_corpus

REPO = Path(__file__).resolve().parent.parent
MAX_BYTES = 4000  # the tree's size cap: big.py is above it
SMALL_VOCAB = (B.MIN_VOCAB + 1, B.VOCAB_RANGE[1])  # tests train tiny vocabularies
UNICODE_SRC = 'GREETING = "héllo 世界 🙂 naïve — ß"\nEND = "<eos>"  # a special-token string as text\n'


def _module_text(i: int) -> str:
    """Distinct, Python-like sources (the split needs enough files to hold some out)."""
    return (f"def function_{i}(x, y={i}):\n    \"\"\"Return x plus {i}.\"\"\"\n"
            f"    for k in range({i % 7 + 1}):\n        x = x + y * k\n    return x\n\n\n"
            f"class Thing{i}:\n    value = {i * 31 % 97}\n")


def write_tree(root: Path) -> dict[str, str]:
    """The tree; returns the files that must be kept (relpath -> text)."""
    kept = {f"pkg/mod_{i:02d}.py": _module_text(i) for i in range(40)}
    kept["pkg/__init__.py"] = "from pkg.mod_00 import function_0\n"
    kept["pkg/uni.py"] = UNICODE_SRC
    kept["vendor/crlf.py"] = "x = 1\r\ny = 2\r\n\tz = '\\t'\r\n"
    for rel, text in kept.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(text.encode("utf-8"))
    # skipped: a duplicate later in sorted order, non-UTF-8 bytes, too large, empty
    (root / "vendor/zz_copy_of_mod_03.py").write_bytes(kept["pkg/mod_03.py"].encode("utf-8"))
    (root / "pkg/latin1.py").write_bytes(b"# caf\xe9\nx = 1\n")
    (root / "pkg/big.py").write_bytes(b"x = 1\n" * (MAX_BYTES // 6 + 1))
    (root / "pkg/empty.py").write_bytes(b"")
    # pruned directories (their .py files must not appear) and files of other extensions
    for d in ("pkg/__pycache__", "site-packages/thirdparty"):
        (root / d).mkdir(parents=True)
        (root / d / "hidden.py").write_text("hidden = True\n")
    (root / "pkg/notes.md").write_text("# Notes\n\nSome *docs*.\n")
    (root / "pkg/data.bin").write_bytes(bytes(range(256)))
    return kept


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("tree") / "lib"
    root.mkdir()
    return root, write_tree(root)


@pytest.fixture(scope="module")
def prepared(tree, tmp_path_factory):
    root, kept = tree
    out = tmp_path_factory.mktemp("out")
    stats = prepare_corpus(out, [root], vocab_size=300, heldout_fraction=0.2, max_file_bytes=MAX_BYTES,
                           vocab_range=SMALL_VOCAB, progress=False)
    return out, stats, kept


def test_collect_keeps_and_skips(tree):
    root, kept = tree
    files, skipped, skipped_dirs = corpus_files.collect_files([root], max_file_bytes=MAX_BYTES)
    assert {f.relpath: f.text for f in files} == kept
    assert [f.relpath for f in files] == sorted(kept)  # the deterministic order
    assert all(f.n_bytes == len(kept[f.relpath].encode("utf-8")) for f in files)
    assert skipped == {"duplicate": 1, "not_utf8": 1, "too_large": 1, "empty": 1}
    assert skipped_dirs == {"pycache_dir": 1, "site_packages_dir": 1}
    with_docs, _, _ = corpus_files.collect_files([root], include_docs=True, max_file_bytes=MAX_BYTES)
    assert {f.relpath for f in with_docs} == set(kept) | {"pkg/notes.md"}
    with pytest.raises(ValueError, match="max_file_bytes=0"):
        corpus_files.collect_files([root], max_file_bytes=0)
    with pytest.raises(ValueError, match="no_such_dir"):
        corpus_files.collect_files([root / "no_such_dir"])


def test_duplicate_keeps_first_in_sorted_order(tmp_path):
    for rel in ("b/x.py", "a/x.py", "c/x.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("same = 1\n")
    files, skipped, _ = corpus_files.collect_files([tmp_path])
    assert [f.relpath for f in files] == ["a/x.py"] and skipped == {"duplicate": 2}


def test_nested_root_walked_once(tmp_path):
    """A stdlib holding its own site-packages, both given as roots: each file once, under its root."""
    std = tmp_path / "python3.12"
    site = std / "site-packages"
    (site / "pkg").mkdir(parents=True)
    (std / "os_like.py").write_text("import sys\n")
    (site / "pkg" / "m.py").write_text("import os\n")
    files, _, dirs = corpus_files.collect_files([std, site, site])
    assert [(f.root_index, f.relpath) for f in files] == [(0, "os_like.py"), (1, "pkg/m.py")]
    assert dirs == {"site_packages_dir": 1}


def test_split_deterministic_disjoint_covering(tree, tmp_path):
    root, kept = tree
    files, _, _ = corpus_files.collect_files([root], max_file_bytes=MAX_BYTES)
    train, held = corpus_split.split_files(files, 0.2)
    names_t, names_h = [f.relpath for f in train], [f.relpath for f in held]
    assert names_t and names_h and not set(names_t) & set(names_h)
    assert sorted(names_t + names_h) == sorted(kept)
    assert all(corpus_split.is_heldout(n, 0.2) for n in names_h)
    # independent of the input order
    shuffled = files[:]
    random.Random(1).shuffle(shuffled)
    t2, h2 = corpus_split.split_files(shuffled, 0.2)
    assert sorted(f.relpath for f in h2) == sorted(names_h)
    # and of where the tree lies
    moved = tmp_path / "elsewhere" / "lib"
    shutil.copytree(root, moved)
    files_m, _, _ = corpus_files.collect_files([moved], max_file_bytes=MAX_BYTES)
    tm, hm = corpus_split.split_files(files_m, 0.2)
    assert [(f.relpath, f.text) for f in hm] == [(f.relpath, f.text) for f in held]
    assert [f.relpath for f in tm] == names_t
    # another salt gives another split (the salt is really used)
    assert {f.relpath for f in corpus_split.split_files(files, 0.2, salt="other")[1]} != set(names_h)


def test_split_fraction_and_errors():
    names = [f"pkg{i // 50}/mod_{i}.py" for i in range(20000)]
    frac = sum(corpus_split.is_heldout(n, 0.02) for n in names) / len(names)
    assert 0.017 < frac < 0.023
    for bad in (0.0, 0.5, -0.1):
        with pytest.raises(ValueError, match=f"fraction={bad}"):
            corpus_split.split_files([], bad)


def test_vocab_range_checks():
    with pytest.raises(ValueError, match="vocab_size=300"):
        B.train_bpe(["x = 1\n"], 300)  # the default range is the CLI's 4096..16384
    with pytest.raises(ValueError, match="vocab_size=16385"):
        B.check_vocab_size(16385)
    with pytest.raises(ValueError, match=f"vocab_size={B.MIN_VOCAB}"):
        B.check_vocab_size(B.MIN_VOCAB, SMALL_VOCAB)  # no room for a single merge
    B.check_vocab_size(4096)
    B.check_vocab_size(16384)


def test_tokenizer_files_and_special_ids(prepared):
    out, stats, _ = prepared
    ids = json.loads((out / "tokenizer_ids.json").read_text())
    assert ids == stats["tokenizer"]
    assert (ids["bos_token_id"], ids["eos_token_id"], ids["pad_token_id"], ids["dspark_noise_token_id"]) == (0, 1, 2, 3)
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    assert set(ids) <= fields  # the keys are the model config's own field names
    info = load_tokenizer(out)
    for key, tok in (("bos_token_id", "<bos>"), ("eos_token_id", "<eos>"), ("pad_token_id", "<pad>"),
                     ("dspark_noise_token_id", "<noise>")):
        assert info.tokenizer.token_to_id(tok) == ids[key]
    assert info.bos_token_id == 0 and info.eos_token_id == 1 and not info.add_bos
    assert {0, 1, 2, 3} <= info.all_special_ids
    assert 260 < ids["vocab_size"] == info.vocab_size <= 300


def test_engine_loader_round_trip_real_source(prepared):
    out, _, _ = prepared
    info = load_tokenizer(out)
    texts = [Path(json.__file__).read_text(encoding="utf-8"), Path(shutil.__file__).read_text(encoding="utf-8"),
             'def f():\n    return "Grüße, 世界 🙂 — ½ ∑ café"\n\r\n\t\x00\x7f end\n']
    for text in texts:
        enc = info.encode(text)
        assert enc and max(enc) < info.vocab_size and not set(enc) & {0, 1, 2, 3}
        assert info.decode(enc) == text


def _decode_docs(out: Path, name: str, eos: int):
    info = load_tokenizer(out)
    ids = np.load(out / f"{name}.npy")
    docs = token_files.split_documents(ids, eos)
    return ids, [info.decode(d.tolist(), skip_special_tokens=False) for d in docs]


def test_token_files_hold_eos_terminated_documents(prepared):
    out, stats, kept = prepared
    eos = stats["tokenizer"]["eos_token_id"]
    all_names = []
    for name in ("train", "heldout"):
        names = (out / f"{name}_files.txt").read_text(encoding="utf-8").splitlines()
        ids, decoded = _decode_docs(out, name, eos)
        assert ids.dtype == np.uint16 and ids.ndim == 1 and ids[-1] == eos
        assert int((ids == eos).sum()) == len(names) == stats["splits"][name]["files"]
        assert decoded == [kept[n] for n in names]
        assert "".join(decoded) == "".join(kept[n] for n in names)
        assert stats["splits"][name]["tokens"] == len(ids)
        assert stats["splits"][name]["bytes"] == sum(len(kept[n].encode("utf-8")) for n in names)
        all_names += names
    assert sorted(all_names) == sorted(kept)  # every kept file in exactly one split
    assert "pkg/uni.py" in all_names  # its literal "<eos>" became text (checked by the decode above)
    assert stats["skipped_files"] == {"duplicate": 1, "not_utf8": 1, "too_large": 1, "empty": 1}


def test_literal_special_string_encodes_as_text(prepared):
    out, _, _ = prepared
    tok = load_tokenizer(out).tokenizer
    ids = token_files.encode_documents(tok, [UNICODE_SRC, "a<bos>b<pad><noise>"], eos_id=1)
    docs = token_files.split_documents(ids, 1)
    assert len(docs) == 2 and len(ids) == len(docs[0]) + len(docs[1]) + 2
    assert all(not set(d.tolist()) & {0, 1, 2, 3} for d in docs)
    assert tok.decode(docs[1].tolist()) == "a<bos>b<pad><noise>"
    assert not tok.encode_special_tokens  # the tokenizer's own setting is restored


def test_compression_bpb_matches_direct():
    data = b"".join(_module_text(i).encode() for i in range(50)) + "héllo 世界".encode()
    got = compression_baseline.compression_bpb(data)
    gz = len(gzip.compress(data, compresslevel=9, mtime=0))
    xz = len(lzma.compress(data, format=lzma.FORMAT_XZ, preset=9 | lzma.PRESET_EXTREME))
    assert got["gzip_bpb"] == 8 * gz / len(data) and got["xz_bpb"] == 8 * xz / len(data)
    assert got["bytes"] == len(data) and 0 < got["xz_bpb"] < got["gzip_bpb"] < 8
    with pytest.raises(ValueError, match="0 bytes"):
        compression_baseline.compression_bpb(b"")


def test_stats_baselines_are_of_heldout_bytes(prepared):
    out, stats, kept = prepared
    names = (out / "heldout_files.txt").read_text(encoding="utf-8").splitlines()
    data = b"".join(kept[n].encode("utf-8") for n in names)
    base = stats["heldout_baselines"]
    direct = compression_baseline.compression_bpb(data)
    assert {k: base[k] for k in direct} == direct
    assert base["target_bpb"] == 0.7 * direct["xz_bpb"]
    assert json.loads((out / "corpus_stats.json").read_text()) == stats
    assert stats["roots"] == [str(Path(stats["roots"][0]).resolve())] and stats["python"]


def _script():
    spec = importlib.util.spec_from_file_location("prepare_corpus", REPO / "scripts/train/prepare_corpus.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cli_one_command(tree, tmp_path, capsys):
    root, kept = tree
    script = _script()
    assert script.main(["--out", str(tmp_path / "o"), "--roots", str(root), "--vocab-size", "4096",
                        "--heldout-fraction", "0.2", "--max-file-bytes", str(MAX_BYTES), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "xz -9e" in text and "engine loader decoded" in text
    for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer_ids.json", "train.npy", "heldout.npy",
              "heldout_files.txt", "corpus_stats.json"):
        assert (tmp_path / "o" / f).is_file(), f
    stats = json.loads((tmp_path / "o" / "corpus_stats.json").read_text())
    assert stats["splits"]["train"]["files"] + stats["splits"]["heldout"]["files"] == len(kept)


@pytest.mark.parametrize("argv, message", [
    (["--vocab-size", "300"], "--vocab-size=300"),
    (["--vocab-size", "20000"], "--vocab-size=20000"),
    (["--heldout-fraction", "0"], "--heldout-fraction=0.0"),
    (["--max-file-bytes", "0"], "--max-file-bytes=0"),
    (["--roots", "/no/such/root"], "/no/such/root"),
])
def test_cli_rejects_bad_flags(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit):
        _script().main(["--out", str(tmp_path / "o")] + argv)
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
