"""Model configuration: DeepSeek-V4.1 read from the Hugging Face ``config.json``.

``ModelConfig`` holds the ``text_config`` fields under their Hugging Face names (see
``shared/design/V41_MODEL.md``), flattened: ``rope_scaling`` becomes the ``yarn_*`` fields and
``quantization_config`` becomes ``weight_dtype`` / ``expert_dtype``. ``validate()`` checks the
cross-field rules and raises ``ValueError`` naming the field and the bad value.

Layer numbering: backbone layers are ``0 .. num_hidden_layers-1``; DSpark stages follow as
``num_hidden_layers .. num_hidden_layers+num_nextn_predict_layers-1`` (checkpoint names ``mtp.K``).
``compress_ratios`` has one entry per layer of both kinds.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

WEIGHT_DTYPES = ("bf16", "fp8")
EXPERT_DTYPES = ("bf16", "fp8", "fp4")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    # --- shapes ---
    vocab_size: int = 129280
    hidden_size: int = 5120
    num_hidden_layers: int = 40
    num_nextn_predict_layers: int = 3
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    rms_norm_eps: float = 1e-20
    swiglu_limit: float = 10.0
    max_position_embeddings: int = 1048576
    # --- rope ---
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn_factor: float = 16.0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_original_max_position_embeddings: int = 65536  # 0 turns YaRN off
    # --- MoE ---
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2304
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    # --- CSA2 attention ---
    compress_ratios: tuple[int, ...] = (0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0)
    kv_source_layer_ids: tuple[int, ...] = (2, 8, 14, 20)
    index_source_layer_ids: tuple[int, ...] = (2, 8, 14, 20, 24, 28, 32, 36)
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    candidate_source_layer_id: int = 20  # -1: no candidate pre-filtering
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    # --- mHC ---
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # --- Engram ---
    engram_layer_ids: tuple[int, ...] = (1, 14)
    engram_num_embeddings: tuple[int, ...] = (384006168, 384016682)
    engram_max_ngram_size: int = 4
    engram_vocab_size: int = 16000000
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_token_id: int = 2
    engram_compressed_vocab_size: int = 99092
    # --- DSpark ---
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 0
    dspark_target_layer_ids: tuple[int, ...] = (37, 38, 39)
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3
    # --- special tokens ---
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2
    image_token_id: int = 129264
    # --- storage (quantization_config) ---
    weight_dtype: str = "fp8"  # dense Linear weights: fp8 e4m3 + ue8m0 32x32 block scales, or bf16
    expert_dtype: str = "fp4"  # routed experts: fp4 e2m1 (two per byte) + ue8m0 per-32 scales
    weight_block_size: int = 32

    # ------------------------------------------------------------------ derived
    @property
    def num_layers_total(self) -> int:
        return self.num_hidden_layers + self.num_nextn_predict_layers

    @property
    def dspark_enabled(self) -> bool:
        return self.dspark_block_size > 0 and self.num_nextn_predict_layers > 0

    @property
    def engram_enabled(self) -> bool:
        return len(self.engram_layer_ids) > 0

    @property
    def engram_n_hash_cols(self) -> int:
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    @property
    def yoco_start_layer(self) -> int:
        """First *decoder* layer: from here on layers write no compressed cache (they read the last
        KV source's), only sliding-window state, so YOCO prefill truncation may skip their early
        prompt positions. ``num_hidden_layers`` when there is no KV source."""
        return max(self.kv_source_layer_ids) + 1 if self.kv_source_layer_ids else self.num_hidden_layers

    def is_backbone(self, layer: int) -> bool:
        return layer < self.num_hidden_layers

    def kv_source_of(self, layer: int) -> int:
        """The KV-source layer whose compressed cache a compressed layer attends to (-1: none)."""
        srcs = [s for s in self.kv_source_layer_ids if s <= layer]
        return srcs[-1] if srcs and self.compress_ratios[layer] > 0 and self.is_backbone(layer) else -1

    def index_source_of(self, layer: int) -> int:
        """The index layer whose top-k indices a compressed layer uses (-1: none)."""
        srcs = [s for s in self.index_source_layer_ids if s <= layer]
        return srcs[-1] if srcs and self.compress_ratios[layer] > 0 and self.is_backbone(layer) else -1

    def uses_candidates(self, layer: int) -> bool:
        return (
            layer in self.index_source_layer_ids
            and 0 <= self.candidate_source_layer_id < layer
        )

    def moe_experts(self, layer: int) -> tuple[int, int]:
        """(routed experts, experts per token) of a layer; DSpark stages have their own counts."""
        if self.is_backbone(layer):
            return self.n_routed_experts, self.num_experts_per_tok
        return (
            self.dspark_n_routed_experts or self.n_routed_experts,
            self.dspark_num_experts_per_tok or self.num_experts_per_tok,
        )

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes).validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> "ModelConfig":
        def bad(field: str, value: Any, why: str) -> None:
            raise ValueError(f"ModelConfig.{field}={value!r}: {why}")

        for f in (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
            "q_lora_rank", "o_groups", "o_lora_rank", "n_routed_experts", "num_experts_per_tok",
            "moe_intermediate_size", "hc_mult", "hc_sinkhorn_iters", "max_position_embeddings",
        ):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                bad(f, v, "must be a positive integer")
        if self.sliding_window < 1:
            bad("sliding_window", self.sliding_window, "window must be >= 1")
        if self.num_nextn_predict_layers < 0:
            bad("num_nextn_predict_layers", self.num_nextn_predict_layers, "must be >= 0")
        if not (0 < self.qk_rope_head_dim <= self.head_dim) or self.qk_rope_head_dim % 2:
            bad("qk_rope_head_dim", self.qk_rope_head_dim, f"must be even and in (0, head_dim={self.head_dim}]")
        if self.num_attention_heads % self.o_groups:
            bad("o_groups", self.o_groups, f"must divide num_attention_heads={self.num_attention_heads}")
        if self.num_experts_per_tok > self.n_routed_experts:
            bad("num_experts_per_tok", self.num_experts_per_tok, f"exceeds n_routed_experts={self.n_routed_experts}")
        if self.n_shared_experts != 1:
            bad("n_shared_experts", self.n_shared_experts, "V4.1 has exactly one shared expert")
        if self.scoring_func != "sqrtsoftplus":
            bad("scoring_func", self.scoring_func, "only 'sqrtsoftplus' is supported")
        if self.weight_dtype not in WEIGHT_DTYPES:
            bad("weight_dtype", self.weight_dtype, f"must be one of {WEIGHT_DTYPES}")
        if self.expert_dtype not in EXPERT_DTYPES:
            bad("expert_dtype", self.expert_dtype, f"must be one of {EXPERT_DTYPES}")
        if self.weight_block_size != 32:
            bad("weight_block_size", self.weight_block_size, "only 32x32 blocks are supported")

        n_total = self.num_layers_total
        ratios = tuple(self.compress_ratios)
        if len(ratios) != n_total:
            bad("compress_ratios", ratios,
                f"length {len(ratios)} != num_hidden_layers + num_nextn_predict_layers = {n_total}")
        for i, r in enumerate(ratios):
            if r not in (0, 1, 2, 4):
                bad("compress_ratios", ratios, f"entry {i} is {r}; supported ratios are 0, 1, 2, 4")
            if r and not self.is_backbone(i):
                bad("compress_ratios", ratios, f"DSpark stage (layer {i}) must have ratio 0")

        def check_layer_list(field: str, need_ratio: bool) -> tuple[int, ...]:
            ids = tuple(getattr(self, field))
            if list(ids) != sorted(set(ids)):
                bad(field, ids, "must be sorted ascending without repeats")
            for i in ids:
                if not 0 <= i < self.num_hidden_layers:
                    bad(field, ids, f"layer {i} is not a backbone layer (0..{self.num_hidden_layers - 1})")
                if need_ratio and ratios[i] == 0:
                    bad(field, ids, f"layer {i} has compress ratio 0")
            return ids

        kv_srcs = check_layer_list("kv_source_layer_ids", True)
        idx_srcs = check_layer_list("index_source_layer_ids", True)
        for i in range(self.num_hidden_layers):
            r = ratios[i]
            if r == 0:
                continue
            src = self.kv_source_of(i)
            if src < 0:
                bad("kv_source_layer_ids", kv_srcs, f"compressed layer {i} has no KV source at or before it")
            if ratios[src] != r:
                bad("kv_source_layer_ids", kv_srcs,
                    f"layer {i} (ratio {r}) would read KV source {src} of ratio {ratios[src]}")
            isrc = self.index_source_of(i)
            if isrc < src:
                bad("index_source_layer_ids", idx_srcs,
                    f"layer {i} has no index layer at or after its KV source {src}")
        for s in kv_srcs:
            if s not in idx_srcs:
                bad("index_source_layer_ids", idx_srcs, f"KV source {s} must also be an index source")
        if self.index_topk < 1:
            bad("index_topk", self.index_topk, "must be >= 1")
        if self.index_n_heads < 1 or self.index_head_dim < 1 or self.index_head_dim % 32:
            bad("index_head_dim", self.index_head_dim, "must be a positive multiple of 32")
        if self.candidate_source_layer_id >= 0:
            c = self.candidate_source_layer_id
            if c not in idx_srcs:
                bad("candidate_source_layer_id", c, "must be one of index_source_layer_ids")
            if self.candidate_topk_blocks < 1 or self.candidate_block_size < 1:
                bad("candidate_topk_blocks", self.candidate_topk_blocks, "candidate pool must be non-empty")
            for i in idx_srcs:
                if i > c and self.kv_source_of(i) != self.kv_source_of(c):
                    bad("candidate_source_layer_id", c,
                        f"index layer {i} uses candidates but reads KV source {self.kv_source_of(i)}, "
                        f"not {self.kv_source_of(c)}")

        if self.engram_enabled:
            eids = tuple(self.engram_layer_ids)
            if list(eids) != sorted(set(eids)) or any(not 0 <= i < self.num_hidden_layers for i in eids):
                bad("engram_layer_ids", eids, "must be sorted backbone layer ids without repeats")
            if len(self.engram_num_embeddings) != len(eids):
                bad("engram_num_embeddings", tuple(self.engram_num_embeddings),
                    f"needs one entry per engram layer ({len(eids)})")
            if self.engram_max_ngram_size < 2:
                bad("engram_max_ngram_size", self.engram_max_ngram_size, "must be >= 2")
            if self.engram_head_dim % 32 or self.engram_head_dim < 32:
                bad("engram_head_dim", self.engram_head_dim, "must be a positive multiple of 32")
            if self.engram_n_heads < 1:
                bad("engram_n_heads", self.engram_n_heads, "must be >= 1")

        if self.dspark_enabled:
            t = tuple(self.dspark_target_layer_ids)
            if not t or list(t) != sorted(set(t)) or any(not 0 <= i < self.num_hidden_layers for i in t):
                bad("dspark_target_layer_ids", t, "must be sorted, non-empty backbone layer ids")
            if not 0 <= self.dspark_noise_token_id < self.vocab_size:
                bad("dspark_noise_token_id", self.dspark_noise_token_id, f"outside vocab (0..{self.vocab_size - 1})")
            n_e, k_e = self.moe_experts(self.num_hidden_layers)
            if k_e > n_e:
                bad("dspark_num_experts_per_tok", k_e, f"exceeds dspark_n_routed_experts={n_e}")
        for f in ("hidden_size", "q_lora_rank", "head_dim", "moe_intermediate_size"):
            v = getattr(self, f)
            if self.weight_dtype != "bf16" and v % 32:
                bad(f, v, "quantized weights need a multiple of 32")
        if self.head_dim % 32:  # any storage: window KV is fp8-rounded per 32, compressed KV fp4 per 16
            bad("head_dim", self.head_dim, "must be a multiple of 32 (the KV caches round it in blocks of 32)")
        if self.weight_dtype != "bf16" and (self.o_groups * self.o_lora_rank) % 32:
            bad("o_lora_rank", self.o_lora_rank, f"o_groups ({self.o_groups}) x o_lora_rank is wo_b's input: "
                                                 "quantized weights need a multiple of 32")
        if self.weight_dtype == "bf16" and self.expert_dtype != "bf16":
            bad("expert_dtype", self.expert_dtype, "quantized experts need weight_dtype='fp8' (config.json "
                                                   "states expert storage only in quantization_config)")
        return self

    # ------------------------------------------------------------------ JSON
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config") -> "ModelConfig":
        """Build from the released ``config.json`` layout (top level + ``text_config`` +
        ``quantization_config``); a flat dict of text fields is accepted too. Every field the
        released config has is required (``missing_required_fields``); ``source`` names the
        config in that error (``from_json`` passes the file)."""
        if not isinstance(d, dict):
            raise ValueError(f"config must be a JSON object, got {type(d).__name__}")
        text = dict(d.get("text_config", d))
        missing = missing_required_fields(text, d)
        if missing:
            where = "text_config." if "text_config" in d else ""
            raise ValueError(f"{source}: missing required field(s) {', '.join(where + m for m in missing)} "
                             "(the released config.json has them; a default would silently be V4.1-Flash's)")
        kw: dict[str, Any] = {}
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for name in fields:
            for src in (text, d):
                if name in src:
                    kw[name] = src[name]
                    break
        rs = text.get("rope_scaling")
        if rs:
            if rs.get("rope_type", rs.get("type", "yarn")) != "yarn":
                raise ValueError(f"rope_scaling.rope_type={rs.get('rope_type')!r}: only 'yarn' is supported")
            for key in ("factor", "original_max_position_embeddings"):
                if key not in rs:
                    raise ValueError(f"{source}: missing required field rope_scaling.{key} (YaRN needs it)")
            kw["yarn_factor"] = rs["factor"]
            kw["yarn_beta_fast"] = rs.get("beta_fast", 32.0)  # Hugging Face's YaRN defaults
            kw["yarn_beta_slow"] = rs.get("beta_slow", 1.0)
            kw["yarn_original_max_position_embeddings"] = rs["original_max_position_embeddings"]
        else:  # rope_scaling null or {}: YaRN off
            kw["yarn_original_max_position_embeddings"] = 0
        if text.get("candidate_source_layer_id", 0) is None:
            kw["candidate_source_layer_id"] = -1
        q = d.get("quantization_config")
        if "weight_dtype" not in kw:
            if q:
                method = q.get("quant_method")
                if method != "fp8":
                    raise ValueError(f"quantization_config.quant_method={method!r}: only 'fp8' is supported")
                if q.get("scale_fmt", "ue8m0") != "ue8m0":
                    raise ValueError(f"quantization_config.scale_fmt={q.get('scale_fmt')!r}: only 'ue8m0' is supported")
                bs = q.get("weight_block_size", [32, 32])
                if list(bs) != [32, 32]:
                    raise ValueError(f"quantization_config.weight_block_size={bs!r}: only [32, 32] is supported")
                kw["weight_dtype"] = "fp8"
                kw["expert_dtype"] = q.get("expert_dtype") or "fp8"
            elif "text_config" in d:
                kw["weight_dtype"] = "bf16"
                kw["expert_dtype"] = "bf16"
        for name, v in list(kw.items()):
            if isinstance(v, list):
                kw[name] = tuple(v)
        for name in ("num_hidden_layers", "vocab_size", "hidden_size"):
            if name in kw and not isinstance(kw[name], int):
                raise ValueError(f"ModelConfig.{name}={kw[name]!r}: must be an integer")
        return cls(**kw).validate()

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "ModelConfig":
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"config file not found: {path}")
        try:
            with open(path) as f:
                d = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        return cls.from_hf_dict(d, source=path)

    def to_hf_dict(self) -> dict[str, Any]:
        """The released ``config.json`` layout (inverse of ``from_hf_dict``)."""
        text: dict[str, Any] = {"model_type": "deepseek_v41_text"}
        skip = {"weight_dtype", "expert_dtype", "weight_block_size", "bos_token_id", "eos_token_id",
                "pad_token_id", "image_token_id"}
        for f in dataclasses.fields(self):
            if f.name in skip or f.name.startswith("yarn_"):
                continue
            v = getattr(self, f.name)
            text[f.name] = list(v) if isinstance(v, tuple) else v
        text["num_key_value_heads"] = 1
        text["hidden_act"] = "silu"
        text["topk_method"] = "noaux_tc"
        text["attention_bias"] = False
        if self.yarn_original_max_position_embeddings > 0:
            text["rope_scaling"] = {
                "rope_type": "yarn",
                "factor": self.yarn_factor,
                "beta_fast": self.yarn_beta_fast,
                "beta_slow": self.yarn_beta_slow,
                "original_max_position_embeddings": self.yarn_original_max_position_embeddings,
            }
        else:
            text["rope_scaling"] = None  # written: the field is required (YaRN off is explicit)
        out: dict[str, Any] = {
            "architectures": ["DeepseekV41ForCausalLM"],
            "model_type": "deepseek_v41",
            "dtype": "bfloat16",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "image_token_id": self.image_token_id,
            "text_config": text,
        }
        if self.weight_dtype == "fp8":
            out["quantization_config"] = {
                "quant_method": "fp8",
                "activation_scheme": "dynamic",
                "weight_block_size": [32, 32],
                "scale_fmt": "ue8m0",
                "expert_dtype": self.expert_dtype,
            }
        return out

    def to_json(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            json.dump(self.to_hf_dict(), f, indent=2)


# Fields the reader may default: the storage fields come from ``quantization_config`` and the
# special-token ids (top level) do not change the model. Every other field of ``ModelConfig``
# (the ``yarn_*`` ones as ``rope_scaling``) is in the released ``text_config`` and required.
_OPTIONAL_FIELDS = frozenset({"weight_dtype", "expert_dtype", "weight_block_size", "bos_token_id",
                              "eos_token_id", "pad_token_id", "image_token_id"})


def _inert_fields(text: dict[str, Any]) -> set[str]:
    """Fields of a feature the config turns off (no Engram layers, no DSpark stages, no candidate
    source): they change nothing, so a config may leave them out."""
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    inert: set[str] = set()
    if text.get("engram_layer_ids") == []:
        inert |= {n for n in names if n.startswith("engram_")} - {"engram_layer_ids"}
    if text.get("num_nextn_predict_layers") == 0:
        inert |= {n for n in names if n.startswith("dspark_")}
    elif text.get("dspark_block_size") == 0:
        inert |= {n for n in names if n.startswith("dspark_")} - {"dspark_block_size"}
    if text.get("candidate_source_layer_id", 0) in (None, -1):
        inert |= {"candidate_topk_blocks", "candidate_block_size"}
    return inert


def missing_required_fields(text: dict[str, Any], top: dict[str, Any]) -> list[str]:
    """The required fields neither ``text`` (``text_config``) nor ``top`` (top level) has."""
    need = [f.name for f in dataclasses.fields(ModelConfig)
            if f.name not in _OPTIONAL_FIELDS and not f.name.startswith("yarn_")]
    need.append("rope_scaling")
    inert = _inert_fields(text)
    return [n for n in need if n not in inert and n not in text and n not in top]


def _flash() -> ModelConfig:
    return ModelConfig()


def _tiny() -> ModelConfig:
    """CPU-sized model with every layer type: ratio 0/2/1 layers, shared KV and index sources,
    candidate blocks, Engram, mHC, MoE with a shared expert, and DSpark stages. Same layer
    schedule as the golden tiny models, with a ring that wraps at short prompts."""
    return ModelConfig(
        vocab_size=256, hidden_size=128, num_hidden_layers=6, num_nextn_predict_layers=2,
        num_attention_heads=4, head_dim=64, qk_rope_head_dim=16, q_lora_rank=64, o_groups=2,
        o_lora_rank=32, sliding_window=8, swiglu_limit=1.0, max_position_embeddings=512,
        yarn_factor=4.0, yarn_original_max_position_embeddings=16,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
        compress_ratios=(0, 2, 2, 1, 1, 1, 0, 0), kv_source_layer_ids=(1, 3),
        index_source_layer_ids=(1, 3, 5), index_n_heads=16, index_head_dim=32, index_topk=8,
        candidate_source_layer_id=3, candidate_topk_blocks=3, candidate_block_size=4,
        engram_layer_ids=(0, 1), engram_num_embeddings=(384, 552), engram_max_ngram_size=4,
        engram_vocab_size=50, engram_n_heads=2, engram_head_dim=32, engram_pad_token_id=2,
        engram_compressed_vocab_size=95, dspark_block_size=3, dspark_noise_token_id=255,
        dspark_target_layer_ids=(3, 4, 5), dspark_markov_rank=32, dspark_n_routed_experts=4,
        dspark_num_experts_per_tok=3,
    ).validate()


PRESETS = {"v41-flash": _flash, "v41-tiny": _tiny}


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[name]()
