"""Seeded random DeepSeek-V4.1 checkpoints in the official storage formats (numpy, no JAX).

``write_random_checkpoint(cfg, out_dir)`` writes ``config.json``, the safetensors shards with
exactly the tensors of ``checkpoint_spec(cfg)`` (+ ``model.safetensors.index.json``) and, by
default, a small WordLevel ``tokenizer.json`` (+ ``tokenizer_config.json``).

Determinism: every weight (with its scale) is drawn from its own ``numpy`` Generator seeded by
``(seed, blake2b(name))``, so values do not depend on tensor order, sharding or config fields
that do not change the tensor's shape.

Value distributions (chosen like the golden tiny checkpoints, which give a numerically healthy
forward; all then rounded into the file format of the tensor):

==================================  =====================================================
tensor                              distribution
==================================  =====================================================
``embed.weight``                    N(0, 0.12)
``mtp.K.markov_head.embed.weight``  N(0, 0.12)
Linear weights (fp8/fp4/bf16,       N(0, 1/sqrt(in_features))
head, compressor, indexer, main
proj, Markov head, confidence)
``ffn.gate.weight``                 N(0, 2.5/sqrt(hidden_size))
``ffn.gate.bias``                   N(0, 0.1)
norm weights                        N(mu, 0.1 mu): mu = 0.05 attn_norm, 0.2 ffn_norm,
                                    0.4 kv_norm, 0.5 indexer k_norm, 0.6 compressor norm,
                                    1 otherwise (q_norm, main_norm, final norms)
``engram.q_weight``/``k_weight``    N(1, 0.1)
``engram.embed.weight``             N(0, 1), fp8 with per-row (1x32) scales
``hc_*_fn``                         N(0, 1/sqrt(hc_mult*hidden_size))
``hc_*_base``                       N(0, 0.5)
``hc_*_scale``                      N(0.5, 0.05)
``attn.attn_sink``                  N(0, 0.5)
==================================  =====================================================
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from typing import Any, Callable

import ml_dtypes
import numpy as np

from deepinfer_jax.base import engram_tables

from deepinfer_jax.checkpoint.spec import TensorSpec, checkpoint_spec, scale_name, weight_name
from deepinfer_jax.checkpoint.quant_formats import quantize_fp4, quantize_fp8_block
from deepinfer_jax.checkpoint.safetensors_io import tensor_nbytes, write_sharded_lazy

__all__ = [
    "write_random_checkpoint",
    "random_tensor_values",
    "write_random_tokenizer",
    "engram_table_rows",
    "tensor_rng",
]

_NORM_MEANS = (
    ("attn_norm.weight", 0.05),
    ("ffn_norm.weight", 0.2),
    ("kv_norm.weight", 0.4),
    ("indexer.k_norm.weight", 0.5),
    ("compressor.norm.weight", 0.6),
)


def tensor_rng(seed: int, name: str) -> np.random.Generator:
    """The Generator for tensor ``name``: depends only on (seed, name)."""
    if int(seed) < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    digest = hashlib.blake2b(name.encode("utf-8"), digest_size=16).digest()
    words = [int.from_bytes(digest[i : i + 4], "little") for i in range(0, 16, 4)]
    return np.random.default_rng(np.random.SeedSequence([int(seed), *words]))


def _distribution(name: str, spec: TensorSpec, cfg: Any) -> tuple[float, float]:
    """(mean, std) of the float values behind tensor ``name``."""
    D = cfg.hidden_size
    if name == "embed.weight" or name.endswith("markov_head.embed.weight"):
        return 0.0, 0.12
    if name.endswith("norm.weight"):
        for suffix, mu in _NORM_MEANS:
            if name.endswith(suffix):
                return mu, 0.1 * mu
        return 1.0, 0.1
    if name.endswith(("engram.q_weight", "engram.k_weight")):
        return 1.0, 0.1
    if spec.kind == "engram_table":
        return 0.0, 1.0
    base = name.rsplit(".", 1)[-1]
    if base.startswith("hc_"):
        if base.endswith("_fn"):
            return 0.0, 1.0 / np.sqrt(spec.shape[1])
        if base.endswith("_base"):
            return 0.0, 0.5
        if base.endswith("_scale"):
            return 0.5, 0.05
    if name.endswith("attn.attn_sink"):
        return 0.0, 0.5
    if name.endswith("ffn.gate.bias"):
        return 0.0, 0.1
    if name.endswith("ffn.gate.weight"):
        return 0.0, 2.5 / np.sqrt(D)
    if name.endswith(".weight") and len(spec.logical_shape) == 2:
        return 0.0, 1.0 / np.sqrt(spec.logical_shape[1])
    raise ValueError(f"no random-init rule for tensor {name!r} ({spec})")


def random_tensor_values(name: str, spec: TensorSpec, cfg: Any, seed: int,
                         scale_spec: TensorSpec | None = None) -> dict[str, np.ndarray]:
    """Random file tensors for ``name`` (and its ``.scale`` for quantized kinds)."""
    if spec.is_scale:
        raise ValueError(f"{name!r} is a scale; ask for its weight {weight_name(name)!r}")
    rng = tensor_rng(seed, name)
    mu, sd = _distribution(name, spec, cfg)
    x = rng.standard_normal(spec.logical_shape, dtype=np.float32)
    x = (x * np.float32(sd) + np.float32(mu)).astype(np.float32)
    k = spec.kind
    if k == "bf16":
        return {name: x.astype(ml_dtypes.bfloat16)}
    if k == "f32":
        return {name: x}
    if k == "fp8_linear":
        q, s = quantize_fp8_block(x, 32)
    elif k == "engram_table":
        q, s = quantize_fp8_block(x, (1, 32))
    elif k == "fp4_linear":
        q, s = quantize_fp4(x, 32)
    else:
        raise ValueError(f"tensor {name!r}: unknown kind {k!r}")
    if scale_spec is not None and s.shape != scale_spec.shape:
        raise AssertionError(f"{name}: scale shape {s.shape} != spec {scale_spec.shape}")
    return {name: q, scale_name(name): s}


# --------------------------------------------------------------------------- engram sizing


def engram_table_rows(cfg: Any) -> tuple[int, ...]:
    """Rows of each Engram layer's table (sum of its primes)."""
    return engram_tables.engram_table_rows(len(cfg.engram_layer_ids), cfg.engram_max_ngram_size,
                                           cfg.engram_n_heads, cfg.engram_vocab_size)


# --------------------------------------------------------------------------- tokenizer

_WORDS = (
    "the of and to in is it you that he was for on are with as his they be at one have this from "
    "or had by hot word but what some we can out other were all there when up use your how said "
    "an each she which do their time if will way about many then them write would like so these "
    "her long make thing see him two has look more day could go come did number sound no most "
    "people my over know water than call first who may down side been now find any new work part "
    "take get place made live where after back little only round man year came show every good me "
    "give our under name very through just form sentence great think say help low line differ "
    "turn cause much mean before move right boy old too same tell does set three want air well "
    "also play small end put home read hand port large spell add even land here must big high "
    "such follow act why ask men change went light kind off need house picture try us again "
    "animal point mother world near build self earth father head stand own page should country"
).split()


def _vocab_tokens(cfg: Any) -> list[str]:
    V = int(cfg.vocab_size)
    noise = cfg.dspark_enabled and cfg.dspark_noise_token_id == V - 1
    specials = ["<bos>", "<eos>", "<pad>"]
    n_regular = V - len(specials) - (1 if noise else 0)
    if n_regular < 0:
        raise ValueError(f"vocab_size={V} is too small for the special tokens")
    seen = set(specials) | {"<noise>"}
    regular: list[str] = []

    def candidates():
        yield from "abcdefghijklmnopqrstuvwxyz"
        yield from "0123456789"
        yield from ".,!?;:'-()"
        yield from _WORDS
        syl = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
        for n in itertools.count(2):
            for parts in itertools.product(syl, repeat=n):
                yield "".join(parts)

    if n_regular:
        for t in candidates():
            if t not in seen:
                seen.add(t)
                regular.append(t)
                if len(regular) == n_regular:
                    break
    return specials + regular + (["<noise>"] if noise else [])


def write_random_tokenizer(cfg: Any, out_dir: str | os.PathLike) -> str:
    """A WordLevel ``tokenizer.json`` of exactly ``cfg.vocab_size`` tokens: ids 0/1/2 =
    ``<bos>``/``<eos>``/``<pad>``, last id ``<noise>`` when it is the DSpark noise token, the rest
    lowercase characters and words. Whitespace pre-tokenizer; decoding joins tokens with spaces.
    Returns the ``tokenizer.json`` path."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens = _vocab_tokens(cfg)
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # " ".join(tokens)
    specials = [t for t in tokens if t.startswith("<") and t.endswith(">") and len(t) > 2]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    if tok.get_vocab_size(with_added_tokens=True) != cfg.vocab_size:
        raise AssertionError("tokenizer size does not match vocab_size")
    out_dir = os.fspath(out_dir)
    path = os.path.join(out_dir, "tokenizer.json")
    tok.save(path)
    tcfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokens[cfg.bos_token_id] if cfg.bos_token_id < len(tokens) else None,
        "eos_token": tokens[cfg.eos_token_id] if cfg.eos_token_id < len(tokens) else None,
        "pad_token": tokens[cfg.pad_token_id] if cfg.pad_token_id < len(tokens) else None,
        "unk_token": "<pad>",
        "model_max_length": int(cfg.max_position_embeddings),
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tcfg, f, indent=2)
    return path


# --------------------------------------------------------------------------- checkpoint


def write_random_model_config(cfg: Any, out_dir: str | os.PathLike, tokenizer: bool = True) -> Any:
    """The non-tensor part of a random checkpoint: ``tokenizer.json`` (when ``tokenizer``) and
    ``config.json`` in ``out_dir``; returns the config they imply (see ``write_random_checkpoint``).
    Benchmarks that draw the weights on the device use this alone."""
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    changes: dict[str, Any] = {}
    tok_path = None
    if tokenizer:
        tok_path = write_random_tokenizer(cfg, out_dir)
    if cfg.engram_enabled:
        if tok_path is not None:
            _, size = engram_tables.compressed_token_map(tok_path)
            changes["engram_compressed_vocab_size"] = int(size)
        changes["engram_num_embeddings"] = engram_table_rows(cfg)
    if changes:
        cfg = cfg.replace(**changes)
    if cfg.engram_enabled and tok_path is not None:
        engram_tables.engram_constants(  # raises when the config and the tokenizer disagree
            tokenizer_path=tok_path, layer_ids=cfg.engram_layer_ids, num_embeddings=cfg.engram_num_embeddings,
            max_ngram_size=cfg.engram_max_ngram_size, vocab_size=cfg.engram_vocab_size, n_heads=cfg.engram_n_heads,
            pad_token_id=cfg.engram_pad_token_id, compressed_vocab_size=cfg.engram_compressed_vocab_size)
    cfg.to_json(os.path.join(out_dir, "config.json"))
    return cfg


def write_random_checkpoint(cfg: Any, out_dir: str | os.PathLike, seed: int = 0, tokenizer: bool = True,
                            max_shard_bytes: int = 2**30, progress: bool = True) -> str:
    """Write a random checkpoint for ``cfg`` into ``out_dir``; returns ``out_dir``.

    With ``tokenizer=True`` a tokenizer is written first and ``engram_compressed_vocab_size``
    is set from it (``engram_hash.compressed_token_map``). ``engram_num_embeddings`` is always
    set to the rows implied by the Engram primes. The (possibly updated) config is what
    ``config.json`` holds and what the tensors follow.
    """
    out_dir = os.fspath(out_dir)
    cfg = write_random_model_config(cfg, out_dir, tokenizer)

    spec = checkpoint_spec(cfg)
    entries = [(n, s.file_dtype, s.shape) for n, s in spec.items()]
    cache: dict[str, np.ndarray] = {}

    def produce(name: str) -> np.ndarray:
        if name in cache:
            return cache.pop(name)
        s = spec[name]
        wname = weight_name(name) if s.is_scale else name
        sname = scale_name(wname) if wname.endswith(".weight") else None
        vals = random_tensor_values(wname, spec[wname], cfg, seed, spec.get(sname) if sname else None)
        out = vals.pop(name)
        cache.update(vals)
        return out

    bar = None
    on_tensor: Callable[[str], None] | None = None
    if progress:
        from tqdm import tqdm

        total_bytes = sum(tensor_nbytes(d, sh) for _, d, sh in entries)
        bar = tqdm(total=len(entries), unit="tensor",
                   desc=f"random checkpoint ({total_bytes / 2**20:.1f} MiB)")
        on_tensor = lambda _name: bar.update(1)  # noqa: E731
    try:
        write_sharded_lazy(out_dir, entries, produce, max_shard_bytes,
                           metadata={"format": "pt", "generator": "deepinfer_jax.random_checkpoint",
                                     "seed": str(int(seed))},
                           on_tensor=on_tensor)
    finally:
        if bar is not None:
            bar.close()
    return out_dir
