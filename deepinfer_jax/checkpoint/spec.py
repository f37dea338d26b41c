"""Every tensor of an official DeepSeek-V4.1 checkpoint for a ``ModelConfig``: name, file dtype,
file shape and a ``kind`` tag (numpy only, no JAX).

Names are the reference's ``state_dict()`` names (= the released shards' names), verified
against the golden ``checkpoint_manifest.json`` files of ``tiny_fp8`` and ``tiny_bf16``.

``kind`` tags (what a loader switches on):

================  ==========================================================================
``fp8_linear``    F8_E4M3 ``[out, in]`` weight of a Linear; its scale is ``<prefix>.scale``
``fp8_scale``     F8_E8M0 ``[ceil(out/32), ceil(in/32)]`` 32x32 block scales of an fp8_linear
``fp4_linear``    I8 ``[out, in/2]`` routed-expert weight, two e2m1 codes per byte (even element
                  in the low nibble); its scale is ``<prefix>.scale``
``fp4_scale``     F8_E8M0 ``[out, ceil(in/32)]`` per-row, per-32-column scales of an fp4_linear
``engram_table``  F8_E4M3 ``[rows, engram_head_dim]`` Engram table (always fp8, any weight_dtype)
``engram_scale``  F8_E8M0 ``[rows, engram_head_dim/32]`` its per-row scales (1x32 blocks)
``bf16``          BF16, any shape (embeddings, norms, bf16 Linear weights, gate.weight, ...)
``f32``           F32 (``hc_*``, ``attn_sink``, ``ffn.gate.bias``)
================  ==========================================================================

Storage rules (golden README, "Weights file"):

* Dense Linear weights -- ``attn.wq_a/wq_b/wkv/wo_a/wo_b``, ``ffn.shared_experts.w1/w2/w3``,
  ``attn.indexer.wq_b``, ``engram.wkv``, ``mtp.0.main_proj`` -- are fp8 + 32x32 scales when
  ``weight_dtype == 'fp8'``, plain BF16 when ``'bf16'``.
* Routed experts ``ffn.experts.E.w1/w2/w3`` follow ``expert_dtype``: fp4 -> I8 + per-32 scales,
  fp8 -> F8_E4M3 + 32x32 scales, bf16 -> BF16 (no scale).
* Always BF16: ``embed``, ``head``, every norm, ``ffn.gate.weight``, compressor ``wkv``/``wgate``,
  indexer ``wk``/``weights_proj``, engram ``q_weight``/``k_weight``, Markov and confidence heads.
* Always F32: ``hc_{attn,ffn}_{fn,base,scale}``, ``attn.attn_sink``, ``ffn.gate.bias``.
* Engram tables: always fp8 with per-row scales.

Which layer holds what: a Compressor (``norm``, ``wkv``, plus ``wgate`` when the ratio is > 1)
only on KV-source layers; an Indexer (``wq_b``, ``weights_proj``) on index-source layers, with
``wk``/``k_norm`` only when the layer is also a KV source; ``engram.*`` on engram layers; DSpark
stage ``mtp.K`` is a block without compressor/indexer/engram, ``mtp.0`` adds
``main_proj``/``main_norm`` and the last stage adds ``norm``, ``markov_head.{embed,head}`` and
``confidence_head.proj``. Ratio-4 compressors are not in the golden data; they are assumed to
have the ratio-2 layout.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["TensorSpec", "KINDS", "checkpoint_spec", "MANIFEST_DTYPES", "scale_name", "weight_name"]

KINDS = ("fp8_linear", "fp8_scale", "fp4_linear", "fp4_scale", "engram_table", "engram_scale", "bf16", "f32")

# torch dtype names used by the golden checkpoint_manifest.json -> safetensors dtype strings
MANIFEST_DTYPES = {
    "bfloat16": "BF16",
    "float32": "F32",
    "float16": "F16",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e8m0fnu": "F8_E8M0",
    "int8": "I8",
    "uint8": "U8",
    "int32": "I32",
    "int64": "I64",
    "bool": "BOOL",
}


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    file_dtype: str  # 'F8_E4M3', 'F8_E8M0', 'I8', 'BF16', 'F32'
    shape: tuple[int, ...]
    kind: str  # one of KINDS

    @property
    def logical_shape(self) -> tuple[int, ...]:
        """Shape of the represented values: ``[out, in]`` for fp4 (the file holds ``in/2``)."""
        if self.kind == "fp4_linear":
            return self.shape[:-1] + (2 * self.shape[-1],)
        return self.shape

    @property
    def is_scale(self) -> bool:
        return self.kind in ("fp8_scale", "fp4_scale", "engram_scale")


def scale_name(weight: str) -> str:
    """``x.weight`` -> ``x.scale``."""
    if not weight.endswith(".weight"):
        raise ValueError(f"{weight!r} is not a '.weight' tensor")
    return weight[: -len(".weight")] + ".scale"


def weight_name(scale: str) -> str:
    """``x.scale`` -> ``x.weight``."""
    if not scale.endswith(".scale"):
        raise ValueError(f"{scale!r} is not a '.scale' tensor")
    return scale[: -len(".scale")] + ".weight"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _Builder:
    def __init__(self, cfg: Any):
        self.cfg = cfg
        self.out: dict[str, TensorSpec] = {}
        self.blk = int(getattr(cfg, "weight_block_size", 32))

    def add(self, name: str, dtype: str, shape: tuple[int, ...], kind: str) -> None:
        if name in self.out:
            raise AssertionError(f"duplicate tensor {name}")
        self.out[name] = TensorSpec(dtype, tuple(int(s) for s in shape), kind)

    def bf16(self, name: str, *shape: int) -> None:
        self.add(name, "BF16", shape, "bf16")

    def f32(self, name: str, *shape: int) -> None:
        self.add(name, "F32", shape, "f32")

    def linear(self, prefix: str, out: int, inp: int, fmt: str) -> None:
        """A Linear ``prefix.weight`` [out, in] stored as fmt in ('fp8', 'fp4', 'bf16')."""
        b = self.blk
        if fmt == "fp8":
            self.add(f"{prefix}.weight", "F8_E4M3", (out, inp), "fp8_linear")
            self.add(f"{prefix}.scale", "F8_E8M0", (_cdiv(out, b), _cdiv(inp, b)), "fp8_scale")
        elif fmt == "fp4":
            if inp % 2:
                raise ValueError(f"{prefix}: fp4 weights need an even input size, got {inp}")
            self.add(f"{prefix}.weight", "I8", (out, inp // 2), "fp4_linear")
            self.add(f"{prefix}.scale", "F8_E8M0", (out, _cdiv(inp, 32)), "fp4_scale")
        elif fmt == "bf16":
            self.bf16(f"{prefix}.weight", out, inp)
        else:
            raise ValueError(f"{prefix}: unknown storage format {fmt!r}")


def checkpoint_spec(cfg: Any) -> dict[str, TensorSpec]:
    """Every tensor of the official checkpoint for ``cfg`` (a ``ModelConfig``), in a stable
    layer-major order: ``embed``, ``layers.0..``, ``mtp.0..``, ``norm``, ``head``."""
    b = _Builder(cfg)
    D = cfg.hidden_size
    H = cfg.num_attention_heads
    hd = cfg.head_dim
    hc = cfg.hc_mult
    V = cfg.vocab_size
    dense = cfg.weight_dtype  # 'fp8' | 'bf16'
    n_hc_mix = (2 + hc) * hc

    b.bf16("embed.weight", V, D)

    def block(p: str, layer: int) -> None:
        # --- attention
        b.f32(f"{p}.attn.attn_sink", H)
        b.linear(f"{p}.attn.wq_a", cfg.q_lora_rank, D, dense)
        b.bf16(f"{p}.attn.q_norm.weight", cfg.q_lora_rank)
        b.linear(f"{p}.attn.wq_b", H * hd, cfg.q_lora_rank, dense)
        b.linear(f"{p}.attn.wkv", hd, D, dense)
        b.bf16(f"{p}.attn.kv_norm.weight", hd)
        b.linear(f"{p}.attn.wo_a", cfg.o_groups * cfg.o_lora_rank, H * hd // cfg.o_groups, dense)
        b.linear(f"{p}.attn.wo_b", D, cfg.o_groups * cfg.o_lora_rank, dense)
        if cfg.is_backbone(layer):
            ratio = cfg.compress_ratios[layer]
            is_kv_src = layer in cfg.kv_source_layer_ids
            if is_kv_src:
                b.bf16(f"{p}.attn.compressor.wkv.weight", hd, D)
                if ratio > 1:
                    b.bf16(f"{p}.attn.compressor.wgate.weight", hd, D)
                b.bf16(f"{p}.attn.compressor.norm.weight", hd)
            if layer in cfg.index_source_layer_ids:
                ih, idim = cfg.index_n_heads, cfg.index_head_dim
                b.linear(f"{p}.attn.indexer.wq_b", ih * idim, cfg.q_lora_rank, dense)
                b.bf16(f"{p}.attn.indexer.weights_proj.weight", ih, D)
                if is_kv_src:
                    b.bf16(f"{p}.attn.indexer.wk.weight", idim, hd)
                    b.bf16(f"{p}.attn.indexer.k_norm.weight", idim)
            if layer in cfg.engram_layer_ids:
                i = list(cfg.engram_layer_ids).index(layer)
                rows = int(cfg.engram_num_embeddings[i])
                ehd = cfg.engram_head_dim
                b.add(f"{p}.engram.embed.weight", "F8_E4M3", (rows, ehd), "engram_table")
                b.add(f"{p}.engram.embed.scale", "F8_E8M0", (rows, _cdiv(ehd, 32)), "engram_scale")
                b.linear(f"{p}.engram.wkv", (hc + 1) * D, cfg.engram_n_hash_cols * ehd, dense)
                b.bf16(f"{p}.engram.q_weight", hc, D)
                b.bf16(f"{p}.engram.k_weight", hc, D)
        b.bf16(f"{p}.attn_norm.weight", D)
        # --- MoE
        n_exp, _ = cfg.moe_experts(layer)
        inter = cfg.moe_intermediate_size
        b.bf16(f"{p}.ffn.gate.weight", n_exp, D)
        b.f32(f"{p}.ffn.gate.bias", n_exp)
        for e in range(n_exp):
            b.linear(f"{p}.ffn.experts.{e}.w1", inter, D, cfg.expert_dtype)
            b.linear(f"{p}.ffn.experts.{e}.w2", D, inter, cfg.expert_dtype)
            b.linear(f"{p}.ffn.experts.{e}.w3", inter, D, cfg.expert_dtype)
        b.linear(f"{p}.ffn.shared_experts.w1", inter, D, dense)
        b.linear(f"{p}.ffn.shared_experts.w2", D, inter, dense)
        b.linear(f"{p}.ffn.shared_experts.w3", inter, D, dense)
        b.bf16(f"{p}.ffn_norm.weight", D)
        # --- mHC
        for sub in ("attn", "ffn"):
            b.f32(f"{p}.hc_{sub}_fn", n_hc_mix, hc * D)
            b.f32(f"{p}.hc_{sub}_base", n_hc_mix)
            b.f32(f"{p}.hc_{sub}_scale", 3)

    for layer in range(cfg.num_hidden_layers):
        block(f"layers.{layer}", layer)
    n_mtp = cfg.num_nextn_predict_layers
    for k in range(n_mtp):
        layer = cfg.num_hidden_layers + k
        p = f"mtp.{k}"
        block(p, layer)
        if k == 0:
            b.linear(f"{p}.main_proj", D, len(cfg.dspark_target_layer_ids) * D, dense)
            b.bf16(f"{p}.main_norm.weight", D)
        if k == n_mtp - 1:
            r = cfg.dspark_markov_rank
            b.bf16(f"{p}.norm.weight", D)
            b.bf16(f"{p}.markov_head.embed.weight", V, r)
            b.bf16(f"{p}.markov_head.head.weight", V, r)
            b.bf16(f"{p}.confidence_head.proj.weight", 1, D + r)
    b.bf16("norm.weight", D)
    b.bf16("head.weight", V, D)
    return b.out
