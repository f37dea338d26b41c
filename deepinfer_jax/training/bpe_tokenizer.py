"""A byte-level BPE tokenizer trained with Hugging Face ``tokenizers``, saved so the engine's
``deepinfer_jax.tokenizer.load_tokenizer`` reads it.

The special tokens take the first ids of the vocabulary, in this order: ``<bos>`` 0, ``<eos>`` 1,
``<pad>`` 2, ``<noise>`` 3 (the DSpark noise token). ``tokenizer_ids.json`` records them under the
``ModelConfig`` field names (``bos_token_id``, ``eos_token_id``, ``pad_token_id``,
``engram_pad_token_id`` = the pad, ``dspark_noise_token_id``) plus the tokenizer's ``vocab_size``,
so a model config can take them as they are.

Byte level (GPT-2 pre-tokenizer regex, no prefix space, the 256 byte symbols always in the
vocabulary): every string encodes, and decoding gives it back exactly. ``tokenizer_config.json``
names the special tokens and sets ``add_bos_token: false``: the training data is documents each
followed by ``<eos>``, with no BOS (token_files.py), and the engine encodes prompts the same way."""

from __future__ import annotations

import json
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BOS, EOS, PAD, NOISE = "<bos>", "<eos>", "<pad>", "<noise>"
SPECIAL_TOKENS = (BOS, EOS, PAD, NOISE)  # ids 0, 1, 2, 3
SPECIAL_IDS = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "engram_pad_token_id": 2,
               "dspark_noise_token_id": 3}
VOCAB_RANGE = (4096, 16384)  # inclusive; what the CLI accepts
DEFAULT_VOCAB_SIZE = 8192
MIN_VOCAB = len(SPECIAL_TOKENS) + 256  # the special tokens and the byte alphabet


def check_vocab_size(vocab_size: int, vocab_range: tuple[int, int] = VOCAB_RANGE) -> None:
    lo, hi = max(vocab_range[0], MIN_VOCAB + 1), vocab_range[1]
    if not lo <= vocab_size <= hi:
        raise ValueError(f"vocab_size={vocab_size}: must be in [{lo}, {hi}]")
    if vocab_size > 65536:
        raise ValueError(f"vocab_size={vocab_size}: token files are uint16, at most 65536")


def new_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def train_bpe(texts, vocab_size: int = DEFAULT_VOCAB_SIZE, vocab_range: tuple[int, int] = VOCAB_RANGE,
              show_progress: bool = False, length: int | None = None) -> Tokenizer:
    """Train on the strings of ``texts`` (each a document); ``vocab_range`` bounds ``vocab_size``
    (tests pass a wider range for tiny vocabularies). The trained vocabulary can be smaller than
    ``vocab_size`` when the text runs out of pairs to merge. Raises ``ValueError`` when the
    special tokens did not land on their ids."""
    check_vocab_size(vocab_size, vocab_range)
    tok = new_tokenizer()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=show_progress)
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    check_special_ids(tok)
    return tok


def check_special_ids(tok: Tokenizer) -> None:
    for i, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != i:
            raise ValueError(f"special token {t!r}: id {tok.token_to_id(t)}, expected {i}")


def token_ids(tok: Tokenizer) -> dict[str, int]:
    """The contents of ``tokenizer_ids.json``."""
    return {**SPECIAL_IDS, "vocab_size": tok.get_vocab_size(with_added_tokens=True)}


def save_tokenizer(tok: Tokenizer, out_dir: str | os.PathLike) -> dict[str, int]:
    """Write ``tokenizer.json``, ``tokenizer_config.json``, ``tokenizer_ids.json``; return the ids."""
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    check_special_ids(tok)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    cfg = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "additional_special_tokens": [NOISE],
           "add_bos_token": False, "add_eos_token": False, "tokenizer_class": "PreTrainedTokenizerFast"}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    ids = token_ids(tok)
    with open(os.path.join(out_dir, "tokenizer_ids.json"), "w") as f:
        json.dump(ids, f, indent=1)
    return ids
