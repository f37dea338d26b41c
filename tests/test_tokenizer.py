"""Tests for deepinfer_jax.tokenizer: loading, incremental detokenization, stop strings.

Fast and CPU-only; nothing here imports JAX. Tokenizers used: the WordLevel tokenizer of the tiny
test model (``write_random_tokenizer``), and byte-level BPE / Metaspace BPE tokenizers trained
on the fly on a tiny corpus with multi-byte characters.
"""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from deepinfer_jax.config import preset
from deepinfer_jax.checkpoint.random_checkpoint import write_random_tokenizer
from deepinfer_jax.tokenizer import IncrementalDetokenizer, StopChecker, TokenizerInfo, load_tokenizer
from deepinfer_jax.tokenizer.byte_level import bytes_to_unicode

CORPUS = [
    "héllo 世界 🙂 hello world",
    "the quick brown fox jumps over the lazy dog",
    "naïve café résumé — déjà vu",
    "世界 你好 世界 🙂🙂 emoji 🚀 rocket",
    "hello héllo hallo hullo 世界",
    "ünïcödé strings with àccents and ß",
] * 4


def _train_bpe(kind: str) -> Tokenizer:
    """A small BPE tokenizer: ``byte`` = GPT-2 style byte-level, ``meta`` = SentencePiece-style."""
    if kind == "byte":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        alphabet = []
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<bos>", "<eos>", "<unk>"],
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


@pytest.fixture(scope="module")
def wordlevel_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("wordlevel")
    write_random_tokenizer(preset("v41-tiny"), d)
    return d


def _write_bpe_dir(d, kind: str, config: dict | None) -> None:
    _train_bpe(kind).save(str(d / "tokenizer.json"))
    if config is not None:
        (d / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("bpe")
    _write_bpe_dir(d, "byte", {"bos_token": {"content": "<bos>", "__type": "AddedToken"},
                               "eos_token": "<eos>", "add_bos_token": True,
                               "chat_template": "{{ bos_token }}{{ messages }}"})
    return d


@pytest.fixture(scope="module")
def meta_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("meta")
    _write_bpe_dir(d, "meta", {"bos_token": "<bos>", "eos_token": "<eos>", "add_bos_token": False})
    return d


# --------------------------------------------------------------------------- loader


def test_no_jax_imported():
    # in a fresh interpreter: other test modules of the suite may have imported JAX already
    code = ("import sys, deepinfer_jax.tokenizer, deepinfer_jax.config, "
            "deepinfer_jax.checkpoint.random_checkpoint; "
            "sys.exit('jax' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_load_wordlevel(wordlevel_dir):
    cfg = preset("v41-tiny")
    info = load_tokenizer(str(wordlevel_dir))
    assert isinstance(info, TokenizerInfo)
    assert info.vocab_size == cfg.vocab_size
    assert info.bos_token_id == cfg.bos_token_id and info.eos_token_id == cfg.eos_token_id
    assert {cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id} <= info.all_special_ids
    # no add_bos_token in the config and no post-processor: no BOS
    assert info.add_bos is False and info.chat_template is None
    ids = info.encode("the world is new")
    assert len(ids) == 4 and cfg.bos_token_id not in ids
    assert info.decode(ids) == "the world is new"  # WordLevel decoding joins with spaces
    # special tokens are skipped by default and kept on request
    with_special = [cfg.bos_token_id, *ids, cfg.eos_token_id]
    assert info.decode(with_special) == "the world is new"
    assert info.decode(with_special, skip_special_tokens=False) == "<bos> the world is new <eos>"
    # ids beyond the tokenizer vocabulary (padded model vocab) decode to nothing
    assert info.decode([ids[0], cfg.vocab_size + 7, ids[1]]) == "the world"
    # add_bos override
    forced = load_tokenizer(wordlevel_dir, add_bos=True)
    assert forced.encode("the world") == [cfg.bos_token_id, *ids[:2]]
    assert forced.encode("<bos> the world") == [cfg.bos_token_id, *ids[:2]]  # not doubled


def test_load_wordlevel_fallback_ids(tmp_path):
    write_random_tokenizer(preset("v41-tiny"), tmp_path)
    (tmp_path / "tokenizer_config.json").unlink()
    info = load_tokenizer(tmp_path, bos_token_id=0, eos_token_id=1)
    assert (info.bos_token_id, info.eos_token_id) == (0, 1)
    assert (info.bos_token, info.eos_token) == ("<bos>", "<eos>")
    assert load_tokenizer(tmp_path).bos_token_id is None


def test_load_bpe_bos(bpe_dir):
    info = load_tokenizer(bpe_dir)
    bos = info.tokenizer.token_to_id("<bos>")
    assert info.bos_token_id == bos and info.eos_token_id == info.tokenizer.token_to_id("<eos>")
    assert info.add_bos and info.chat_template == "{{ bos_token }}{{ messages }}"
    text = "héllo 世界 🙂"
    ids = info.encode(text)
    assert ids[0] == bos and ids.count(bos) == 1
    assert info.decode(ids) == text
    assert info.encode("<bos>" + text) == ids  # BOS already present: not added again
    assert info.decode(ids, skip_special_tokens=False) == "<bos>" + text
    no_bos = load_tokenizer(bpe_dir, add_bos=False)
    assert no_bos.encode(text) == ids[1:]


def test_load_bos_from_post_processor(tmp_path):
    from tokenizers import processors

    tok = _train_bpe("byte")
    bos = tok.token_to_id("<bos>")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    tok.save(str(tmp_path / "tokenizer.json"))
    info = load_tokenizer(tmp_path, bos_token_id=bos)
    assert info.add_bos
    ids = info.encode("hello")
    assert ids[0] == bos and ids.count(bos) == 1


def test_missing_tokenizer_json(tmp_path):
    missing = tmp_path / "no_such_model"
    with pytest.raises(ValueError, match="no_such_model"):
        load_tokenizer(str(missing))
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(tmp_path)


# --------------------------------------------------------------------------- detokenizer


def _stream(info, prompt, output, skip, rng=None):
    """Push ``output`` one token at a time (or in random chunks with ``rng``); return the text."""
    detok = IncrementalDetokenizer(info, prompt, skip_special_tokens=skip)
    parts, i = [], 0
    while i < len(output):
        n = 1 if rng is None else rng.randint(1, 6)
        parts.append(detok.push(output[i:i + n]))
        i += n
    parts.append(detok.finish())
    text = "".join(parts)
    assert text == detok.text and detok.token_ids == list(output)
    return text


def _check_random(info, seed, n_cases, vocab_hi):
    rng = random.Random(seed)
    checked = 0
    for case in range(n_cases):
        skip = case % 3 != 2
        prompt = [rng.randrange(vocab_hi) for _ in range(rng.choice([0, 1, 3, 8, 20]))]
        output = [rng.randrange(vocab_hi) for _ in range(rng.choice([1, 2, 5, 17, 40]))]
        full = info.decode(prompt + output, skip_special_tokens=skip)
        pre = info.decode(prompt, skip_special_tokens=skip)
        if not full.startswith(pre):
            continue  # prompt ends inside a character the output completes: no clean suffix
        want = full[len(pre):]
        assert _stream(info, prompt, output, skip) == want, (prompt, output, skip)
        assert _stream(info, prompt, output, skip, rng) == want, (prompt, output, skip)
        checked += 1
    assert checked >= n_cases // 2
    return checked


@pytest.mark.parametrize("which", ["wordlevel", "bpe", "meta"])
def test_detok_random_matches_full_decode(which, wordlevel_dir, bpe_dir, meta_dir):
    d = {"wordlevel": wordlevel_dir, "bpe": bpe_dir, "meta": meta_dir}[which]
    info = load_tokenizer(d)
    # + a few ids past the vocabulary, as a model with a padded vocab may sample
    seed = {"wordlevel": 1, "bpe": 2, "meta": 3}[which]
    _check_random(info, seed=seed, n_cases=300, vocab_hi=info.vocab_size + 3)


def test_detok_multibyte_split_held_back(bpe_dir):
    info = load_tokenizer(bpe_dir)
    # one token per byte of "🙂" (4 bytes): nothing comes out until the character is complete
    byte_tok = {b: info.tokenizer.token_to_id(c) for b, c in bytes_to_unicode().items()}
    emoji = [byte_tok[b] for b in "🙂".encode()]
    assert None not in emoji
    prompt = info.encode("hello")
    detok = IncrementalDetokenizer(info, prompt)
    assert [detok.push([t]) for t in emoji[:3]] == ["", "", ""]
    assert detok.num_held_tokens == 3
    assert detok.push(emoji[3:]) == "🙂"
    assert detok.push(info.encode(" 世界")[1:]) == " 世界"
    assert detok.finish() == "" and detok.text == "🙂 世界"
    # an incomplete sequence at the end is flushed by finish()
    detok = IncrementalDetokenizer(info, prompt)
    assert detok.push(emoji[:2]) == ""
    assert detok.finish() == info.decode(emoji[:2]) == "\ufffd"


def test_detok_first_token_leading_space(wordlevel_dir, meta_dir):
    for d in (wordlevel_dir, meta_dir):
        info = load_tokenizer(d)
        prompt = info.encode("hello world")
        out = info.encode("the")
        detok = IncrementalDetokenizer(info, prompt)
        text = detok.push(out) + detok.finish()
        assert text.startswith(" ") and text.strip()
        assert text == info.decode(prompt + out)[len(info.decode(prompt)):]
        # empty prompt: no leading space, as in a full decode
        detok = IncrementalDetokenizer(info, [])
        assert detok.push(out) + detok.finish() == info.decode(out)


def test_detok_prompt_tail_of_specials(wordlevel_dir):
    info = load_tokenizer(wordlevel_dir)
    eos = info.eos_token_id
    prompt = info.encode("a b") + [eos] * 10  # the window must reach past the skipped specials
    out = info.encode("c d")
    detok = IncrementalDetokenizer(info, prompt)
    assert detok.push(out[:1]) == " c" and detok.push([eos]) == "" and detok.push(out[1:]) == " d"


def test_byte_level_tables_used_and_equal_to_the_general_path(bpe_dir, meta_dir, wordlevel_dir):
    """Byte-level tokenizers stream through their byte tables (no tokenizer call per token) and
    emit exactly what the general window algorithm emits: random prompts (some ending inside a
    multi-byte character, where the general path is kept), outputs with split characters,
    specials and ids past the vocabulary, both skip settings, pushed one by one and in chunks."""
    info = load_tokenizer(bpe_dir)
    assert info.byte_table(True) is not None and info.byte_table(False) is not None
    general = dataclasses.replace(info, _byte_tables=())
    assert general.byte_table(True) is None
    for d in (meta_dir, wordlevel_dir):  # not byte-level: the general path
        assert load_tokenizer(d).byte_table(True) is None
    byte_tok = [info.tokenizer.token_to_id(c) for c in bytes_to_unicode().values()]
    specials = sorted(info.all_special_ids)
    rng = random.Random(7)
    fast_cases = 0
    for case in range(400):
        skip = case % 3 != 2
        pool = [lambda: rng.randrange(info.vocab_size + 3), lambda: rng.choice(byte_tok),
                lambda: rng.choice(specials)]
        weights = (6, 3, 1)
        prompt = [rng.choices(pool, weights)[0]() for _ in range(rng.choice([0, 1, 3, 8]))]
        output = [rng.choices(pool, weights)[0]() for _ in range(rng.choice([1, 2, 5, 17, 40]))]
        fast = IncrementalDetokenizer(info, prompt, skip_special_tokens=skip)
        fast_cases += fast._table is not None
        slow = IncrementalDetokenizer(general, prompt, skip_special_tokens=skip)
        chunks, i = [], 0
        while i < len(output):
            # one at a time, a few at a time, or the whole output at once (the engine's batched push)
            n = 1 if case % 2 else (len(output) if case % 4 == 0 else rng.randint(1, 6))
            chunks.append(output[i:i + n])
            i += n
        for c in chunks:
            assert fast.push(c) == slow.push(c), (prompt, output, skip)
            assert fast.num_held_tokens == slow.num_held_tokens
        assert fast.finish() == slow.finish()
        assert fast.text == slow.text and fast.token_ids == slow.token_ids == output
    assert fast_cases > 200  # the others: prompts whose tail text ends with U+FFFD


def test_shipped_tokenizer_is_byte_level():
    info = load_tokenizer(Path(__file__).resolve().parents[1] / "deepinfer_jax" / "assets" / "v41-small-code")
    assert info.byte_table(True) is not None


# --------------------------------------------------------------------------- stop strings


def _feed(checker, deltas):
    """Append deltas one by one; return (stopped, final text) as the engine would."""
    text = ""
    for d in deltas:
        text += d
        stopped, cut = checker.check(text, len(d))
        if stopped:
            return True, text[:cut]
    return False, text


def test_stop_split_across_deltas():
    c = StopChecker(["STOP"], include_stop_str_in_output=False)
    assert c.max_holdback == 3
    assert _feed(c, ["hello ST", "OP and more"]) == (True, "hello ")
    assert _feed(c, ["hello S", "T", "O", "Pxyz"]) == (True, "hello ")
    c = StopChecker(["STOP"], include_stop_str_in_output=True)
    assert _feed(c, ["hello ST", "OP and more"]) == (True, "hello STOP")


def test_stop_earliest_wins():
    c = StopChecker(["world", "lo"], include_stop_str_in_output=False)
    assert c.check("hello world", 11) == (True, 3)  # "lo" before "world"
    c = StopChecker(["lo", "world"], include_stop_str_in_output=True)
    assert c.check("hello world", 11) == (True, 5)
    # overlapping: the match that completes first wins, independent of delta chunking
    c = StopChecker(["xabcd", "bc"], include_stop_str_in_output=False)
    assert c.check("..xabcd", 7) == (True, 4)
    assert _feed(c, ["..xab", "cd"]) == (True, "..xa")
    # same end: the longer (earlier-starting) one
    c = StopChecker(["bc", "abc"], include_stop_str_in_output=False)
    assert c.check("zabc", 4) == (True, 1)


def test_stop_no_false_match_and_region():
    c = StopChecker(["END", "\n\n"], include_stop_str_in_output=False)
    assert c.max_holdback == 2
    assert _feed(c, ["EN", "d", "\n", "x\n"]) == (False, "ENd\nx\n")
    # a stop string entirely before the new delta is not reported again
    assert c.check("ab END cd", 3) == (False, None)
    assert c.check("ab END", 1) == (True, 3)
    assert c.check("anything", 0) == (False, None)
    assert StopChecker([], False).check("abc", 3) == (False, None)
    assert StopChecker([], False).max_holdback == 0
    assert StopChecker(["", "x"], True).stop == ["x"]


def test_stop_truncation_with_detokenizer(wordlevel_dir):
    info = load_tokenizer(wordlevel_dir)
    detok = IncrementalDetokenizer(info, info.encode("the"))
    checker = StopChecker(["world is"], include_stop_str_in_output=False)
    result = None
    for t in info.encode("new world is here"):
        delta = detok.push([t])
        stopped, cut = checker.check(detok.text, len(delta))
        if stopped:
            result = detok.text[:cut]
            break
    assert result == " new "
