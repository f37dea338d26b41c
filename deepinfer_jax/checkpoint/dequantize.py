"""An fp8 / fp4 checkpoint directory -> the same model with BF16 Linear weights.

Every fp8 e4m3 (32x32 ue8m0 block scale) and fp4 e2m1 (ue8m0 scale per 32 inputs) weight is
written as its dequantized value in BF16, which holds it exactly (e4m3 and e2m1 have at most 3
mantissa bits, BF16 has 7; the scales are powers of two). So the BF16 copy stores the very
weights the quantized model computes with, and quantizing it again (``training/export.py``)
gives the same values back. Other tensors (BF16 / F32, Engram tables) are copied as they are.

The use: training that needs BF16 storage (the DSpark stages, ``scripts/train/train_dspark.py``)
on the shipped fp8 model's exact backbone.
"""

from __future__ import annotations

import os
import shutil

import ml_dtypes
import numpy as np

from deepinfer_jax.checkpoint.quant_formats import dequantize_fp4, dequantize_fp8_block
from deepinfer_jax.checkpoint.safetensors_io import open_checkpoint_dir, write_sharded_lazy
from deepinfer_jax.checkpoint.spec import checkpoint_spec, scale_name
from deepinfer_jax.config import ModelConfig

__all__ = ["dequantize_checkpoint"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer_ids.json")


def dequantize_checkpoint(src_dir: str | os.PathLike, out_dir: str | os.PathLike,
                          max_shard_bytes: int = 2**30) -> str:
    """Write the BF16-weight copy of checkpoint ``src_dir`` to ``out_dir`` (its tokenizer files
    too); returns ``out_dir``."""
    src_dir, out_dir = os.fspath(src_dir), os.fspath(out_dir)
    if os.path.realpath(src_dir) == os.path.realpath(out_dir):
        raise ValueError(f"dequantize_checkpoint: out_dir={out_dir!r} is the source directory")
    cfg = ModelConfig.from_json(src_dir)
    out_cfg = cfg.replace(weight_dtype="bf16", expert_dtype="bf16")
    spec_in, spec_out = checkpoint_spec(cfg), checkpoint_spec(out_cfg)
    with open_checkpoint_dir(src_dir) as reader:
        missing = [n for n in spec_in if n not in reader]
        if missing:
            raise ValueError(f"{src_dir}: checkpoint lacks {len(missing)} tensors of its config, e.g. {missing[0]!r}")

        def produce(name: str) -> np.ndarray:
            kind = spec_in[name].kind
            if kind == "fp8_linear":
                w = dequantize_fp8_block(reader.get(name), reader.get(scale_name(name)), 32)
            elif kind == "fp4_linear":
                w = dequantize_fp4(reader.get(name), reader.get(scale_name(name)), 32)
            else:
                return reader.get(name)
            return w.astype(ml_dtypes.bfloat16)

        os.makedirs(out_dir, exist_ok=True)
        out_cfg.to_json(os.path.join(out_dir, "config.json"))
        entries = [(n, s.file_dtype, s.shape) for n, s in spec_out.items()]
        write_sharded_lazy(out_dir, entries, produce, max_shard_bytes,
                           metadata={"format": "pt", "generator": "deepinfer_jax.checkpoint.dequantize"})
    for f in _TOKENIZER_FILES:
        p = os.path.join(src_dir, f)
        if os.path.isfile(p):
            shutil.copy(p, out_dir)
    return out_dir
