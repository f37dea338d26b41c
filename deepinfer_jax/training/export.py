"""Trained weights -> an official-format checkpoint directory (``config.json`` + safetensors with
the tensors of ``checkpoint_spec``), loadable by ``models.weights.load_model``.

``weight_dtype`` / ``expert_dtype`` of the export config pick the storage: ``bf16`` writes the
weights the training forward computed with (the fp32 masters cast to bf16), so the export's
logits are the trained model's exactly; ``fp8`` / ``fp4`` quantize the fp32 masters
(``checkpoint/quant_formats.py``: e4m3 with ue8m0 32x32 block scales, e2m1 experts with a ue8m0
scale per 32 inputs). Tensors the checkpoint always keeps in BF16 / F32 are written as the
trained model holds them, and so are the Engram tables (always e4m3 codes with per-row ue8m0
scales, in every weight_dtype): the trained codes (the e4m3 rounding the training forward used)
and their frozen scales, so both exports compute the trained Engram rows exactly.
"""

from __future__ import annotations

import os
import re

import ml_dtypes
import numpy as np
from flax import nnx

from deepinfer_jax.checkpoint.quant_formats import quantize_fp4, quantize_fp8_block
from deepinfer_jax.checkpoint.safetensors_io import write_sharded_lazy
from deepinfer_jax.checkpoint.spec import checkpoint_spec
from deepinfer_jax.training.params import path_name

_EXPERT_FILE = re.compile(r"^(.*\.ffn\.experts)\.(\d+)\.(w[123]\.weight)$")


def _flat(state) -> dict[str, np.ndarray]:
    out = {}
    for path, var in nnx.to_flat_state(state):
        out[path_name(path)] = np.asarray(var.get_value() if hasattr(var, "get_value") else var)
    return out


def _lookup(values: dict[str, np.ndarray], name: str) -> np.ndarray | None:
    m = _EXPERT_FILE.match(name)
    if m:
        stacked = values.get(f"{m.group(1)}.{m.group(3)}")
        return None if stacked is None else stacked[int(m.group(2))]
    return values.get(name)


def export_checkpoint(trainer, master, out_dir: str | os.PathLike, weight_dtype: str = "bf16",
                      expert_dtype: str | None = None, max_shard_bytes: int = 2**30,
                      backbone_master=None) -> str:
    """Write the model of ``trainer`` with weights ``master`` to ``out_dir``; returns ``out_dir``.
    ``trainer``: a ``Trainer`` or a ``DSparkTrainer`` (its model holds the trained stages; the
    frozen backbone is written as that model holds it). ``backbone_master``: fp32 masters of
    weights ``master`` lacks (the backbone run's, with a ``DSparkTrainer``), which an fp8 / fp4
    export quantizes from instead of their bf16 storage values."""
    expert_dtype = expert_dtype or ("fp4" if weight_dtype == "fp8" else "bf16")
    cfg = trainer.cfg.replace(weight_dtype=weight_dtype, expert_dtype=expert_dtype)
    model_vals = _flat(nnx.state(trainer.model(master)))  # the trained model's dtypes (bf16 / f32)
    master_vals = {} if backbone_master is None else {k: v.astype(np.float32) for k, v in _flat(backbone_master).items()}
    master_vals |= {k: v.astype(np.float32) for k, v in _flat(master).items()}
    spec = checkpoint_spec(cfg)
    cache: dict[str, np.ndarray] = {}

    def produce(name: str) -> np.ndarray:
        if name in cache:
            return cache.pop(name)
        s = spec[name]
        if s.kind in ("bf16", "f32"):
            v = _lookup(model_vals, name)
            if v is None:
                raise ValueError(f"export: the trained model has no tensor {name}")
            return v.astype(ml_dtypes.bfloat16 if s.kind == "bf16" else np.float32)
        if s.kind in ("engram_table", "engram_scale"):
            v = _lookup(model_vals, name)
            want = np.dtype(ml_dtypes.float8_e4m3fn) if s.kind == "engram_table" else np.dtype(np.uint8)
            if v is None or v.dtype != want:
                raise ValueError(f"export: tensor {name}: the trained model has "
                                 f"{None if v is None else v.dtype}, expected {want}")
            return v
        if s.kind in ("fp8_linear", "fp4_linear"):
            v = _lookup(master_vals, name)
            if v is None:  # a frozen weight: its model value (bf16) is exact in fp32
                v = _lookup(model_vals, name)
            if v is None:
                raise ValueError(f"export: the trained model has no tensor {name}")
            q, sc = (quantize_fp8_block if s.kind == "fp8_linear" else quantize_fp4)(np.asarray(v, np.float32), 32)
            cache[name[: -len(".weight")] + ".scale"] = sc
            return q
        raise ValueError(f"export: tensor {name} of kind {s.kind!r} is not supported yet")

    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    cfg.to_json(os.path.join(out_dir, "config.json"))
    entries = [(n, s.file_dtype, s.shape) for n, s in spec.items()]
    write_sharded_lazy(out_dir, entries, produce, max_shard_bytes,
                       metadata={"format": "pt", "generator": "deepinfer_jax.training.export"})
    return out_dir
