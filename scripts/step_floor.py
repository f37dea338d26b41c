"""Lower bounds on one forward step of the model: the bytes it must read from HBM and the matmul
FLOPs it must run, from the model's parameter shapes and the step's shape (``bench_e2e.py``
divides them by the copy and dense-GEMM rates measured in the same run).

What counts (an estimate of the arrays the step reads, each at least once; not a trace):

* weights: every parameter of the main layers and the head, each read once. The DSpark stages
  (``mtp.*``) are left out: a plain forward step does not run them. The embedding table and the
  Engram tables count only the rows the step's tokens look up. A layer's routed experts count
  with the expected fraction that its tokens touch (``1 - (1 - k/E)^tokens``).
* cache, per main layer and token: the sliding window (``min(window, position + 1)`` entries;
  the tokens of one row share it), the compressed entries attention reads (``min(index_topk,
  visible)`` per token) in ratio-r layers, and, in index-source layers, the index keys the
  indexer scans once per row (all visible compressed positions; a ratio-1 index source other
  than the candidate source scans only the candidate blocks). Prefill reads no cache: its keys
  come from the step itself.
* FLOPs: 2 x weight elements x tokens for every dense matmul (the routed experts at ``k/E`` of
  their elements per token, the head at its logit rows), attention's ``4 x heads x head_dim``
  per attended entry and the indexer's ``2 x index heads x index head_dim`` per scanned key.

Norms, mHC mixes, activations and the sampler are left out: small next to the above at these
shapes; the floor is a lower bound either way.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass
class StepShape:
    """Rows of ``tokens`` tokens each, the last at position ``end - 1`` (decode and
    verification rows: ``end`` = context; prefill: one row from position 0)."""
    rows: int
    tokens: int
    end: int
    logit_rows: int
    prefill: bool = False
    index_key_bytes: float = 2.0   # bytes per index-key element (bf16; fp8 codes + scale ~1.03)
    window_kv_bytes: float = 2.0   # bytes per window-KV element (bf16; packed fp8 + scale bytes 1 + 1/32)
    comp_kv_bytes: float = 2.0     # bytes per compressed-KV element (bf16; packed fp4 + e4m3 scales 1/2 + 1/16)

    @classmethod
    def cache_bytes(cls, kv_cache_dtype: str = "bf16", index_key_dtype: str = "bf16", index_head_dim: int = 128) -> dict:
        """The three per-element byte counts of a cache format (``StepShape(**...)`` keywords); fp8
        index keys carry a 4-byte scale per key of ``index_head_dim`` codes."""
        packed = kv_cache_dtype == "packed"
        return dict(window_kv_bytes=1 + 1 / 32 if packed else 2.0, comp_kv_bytes=0.5 + 1 / 16 if packed else 2.0,
                    index_key_bytes=1 + 4 / index_head_dim if index_key_dtype == "fp8" else 2.0)

    @property
    def total_tokens(self) -> int:
        return self.rows * self.tokens


def _nbytes(shape, dtype) -> int:
    import numpy as np

    return math.prod(shape) * np.dtype(dtype).itemsize


def _weight_elements(name: str, shape, dtype) -> int:
    """Logical weight elements of a parameter (fp4 experts: two per stored byte)."""
    packed = ".experts." in name and name.endswith(".weight") and str(dtype) == "uint8"
    return math.prod(shape) * (2 if packed else 1)


def step_floor(cfg, flat_params, s: StepShape) -> dict:
    """``{"bytes", "flops", "parts": {...}}`` for one step of shape ``s``. ``flat_params``:
    ``(name, shape, dtype)`` of every parameter (``models.weights.param_path_name`` names)."""
    T = s.total_tokens
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    touched = 1.0 - (1.0 - k / E) ** T if E else 0.0
    lookups = cfg.engram_n_heads * (cfg.engram_max_ngram_size - 1)
    parts = dict(weights=0.0, window_kv=0.0, compressed_kv=0.0, index_keys=0.0)
    flops = dict(matmul=0.0, attention=0.0, indexer=0.0)
    for name, shape, dtype in flat_params:
        if name.startswith("mtp."):
            continue
        b = _nbytes(shape, dtype)
        if name == "embed.weight":
            parts["weights"] += min(b, T * b / shape[0])
            continue
        if ".engram.embed." in name:
            parts["weights"] += min(b, T * lookups * b / shape[0])
            continue
        if ".experts." in name:
            parts["weights"] += b * touched
            if name.endswith(".weight"):
                flops["matmul"] += 2.0 * _weight_elements(name, shape, dtype) / E * k * T
            continue
        parts["weights"] += b
        if name.endswith(".weight") and len(shape) == 2 and "norm" not in name:
            rows = s.logit_rows if name == "head.weight" else T
            flops["matmul"] += 2.0 * shape[0] * shape[1] * rows
    A, H = cfg.head_dim, cfg.num_attention_heads
    J, I = cfg.index_head_dim, cfg.index_n_heads
    first = s.end - s.tokens  # position of each row's first token
    for layer, r in enumerate(cfg.compress_ratios[:cfg.num_hidden_layers]):
        for t in range(s.tokens):
            pos = first + t
            win = min(cfg.sliding_window, pos + 1)
            sel = min(cfg.index_topk, (pos + 1) // r) if r else 0
            flops["attention"] += s.rows * 4.0 * H * A * (win + sel)
            if not s.prefill:
                parts["compressed_kv"] += s.rows * sel * A * s.comp_kv_bytes
        if not s.prefill:
            parts["window_kv"] += s.rows * (min(cfg.sliding_window, first + 1) + s.tokens - 1) * A * s.window_kv_bytes
        if r and layer in cfg.index_source_layer_ids:
            visible = s.end // r
            if r == 1 and layer != cfg.candidate_source_layer_id:
                visible = min(visible, cfg.candidate_topk_blocks * cfg.candidate_block_size)
            if not s.prefill:
                parts["index_keys"] += s.rows * visible * J * s.index_key_bytes
            # each token scores the keys visible to it (prefill: on average half of them)
            per_token = visible / 2 if s.prefill else visible
            flops["indexer"] += T * 2.0 * I * J * per_token
    return dict(bytes=sum(parts.values()), flops=sum(flops.values()), parts=parts, flop_parts=flops)


def params_of(cfg) -> list[tuple[str, tuple, object]]:
    """``(name, shape, dtype)`` of the model's parameters, from its abstract state (no memory)."""
    from flax import nnx

    from deepinfer_jax.models.weights import abstract_model, param_path_name

    _, abstract = abstract_model(cfg)
    return [(param_path_name(p), tuple(v.shape), v.dtype) for p, v in nnx.to_flat_state(abstract)]
