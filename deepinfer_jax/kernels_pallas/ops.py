"""The hot ops behind one function each; the model calls only these.

Each op has a pure-jnp reference (``*_ref.py`` beside this file: the oracle for tests and the
path on CPU). Pallas kernels (NVIDIA GPU) and Ascend custom calls plug in here per platform;
``set_backend("reference")`` (or ``DEEPINFER_KERNELS=reference``) forces the references anywhere.
Until a kernel is registered for an op, every platform runs the reference.
"""

from __future__ import annotations

import importlib
import os
import warnings
from typing import Callable

from deepinfer_jax.kernels_pallas import indexer_topk_ref, moe_gmm_ref, sinkhorn_ref, sparse_attention_ref

_BACKEND = os.environ.get("DEEPINFER_KERNELS", "auto")
_KERNELS: dict[tuple[str, str], Callable] = {}  # (op, platform) -> implementation
# Kernel modules imported on first use on their platform; each registers its ops on import.
# (kernels_pallas/sinkhorn.py is not listed yet: it has not run on a GPU; see its docstring.)
_KERNEL_MODULES: dict[str, tuple[str, ...]] = {
    "gpu": ("deepinfer_jax.kernels_pallas.sparse_attention", "deepinfer_jax.kernels_pallas.indexer_topk",
            "deepinfer_jax.kernels_pallas.moe_gmm"),
}
_LOADED: set[str] = set()


def _load_kernels(platform: str) -> None:
    if platform in _LOADED:
        return
    _LOADED.add(platform)
    for mod in _KERNEL_MODULES.get(platform, ()):
        try:
            importlib.import_module(mod)
        except Exception as e:  # a broken kernel module must not take the reference path down
            warnings.warn(f"kernel module {mod} not loaded ({type(e).__name__}: {e}); "
                          "using the references", RuntimeWarning, stacklevel=3)


def set_backend(name: str) -> None:
    """``auto`` (kernel where one is registered for the platform) or ``reference``."""
    global _BACKEND
    if name not in ("auto", "reference"):
        raise ValueError(f"kernel backend {name!r}: expected 'auto' or 'reference'")
    _BACKEND = name


def register_kernel(op: str, platform: str, fn: Callable) -> None:
    _KERNELS[(op, platform)] = fn


def _pick(op: str, ref: Callable) -> Callable:
    if _BACKEND == "reference":
        return ref
    import jax

    platform = jax.default_backend()
    _load_kernels(platform)
    return _KERNELS.get((op, platform), ref)


def sparse_attention(q_THA, pools, idxs, sink_H, scale: float, exact: bool = True):
    """Sparse MQA attention with sink over gathered entries of ``pools`` (see the reference)."""
    return _pick("sparse_attention", sparse_attention_ref.sparse_attention_ref)(q_THA, pools, idxs, sink_H, scale, exact)


def indexer_scores(q_TIJ, k_TNJ, w_TI, n_visible_T):
    return _pick("indexer_scores", indexer_topk_ref.indexer_scores_ref)(q_TIJ, k_TNJ, w_TI, n_visible_T)


def indexer_scores_pool(q_TIJ, pool_PJ, entry_RN, token_row_T, w_TI, n_visible_T, pool_scale_P=None):
    """``indexer_scores`` with keys ``pool_PJ[entry_RN[token_row_T[t]]]`` read in place (no gather copy);
    with ``pool_scale_P`` the pool holds codes scaled per entry (``quant.pack_index_keys``)."""
    return _pick("indexer_scores_pool", indexer_topk_ref.indexer_scores_pool_ref)(q_TIJ, pool_PJ, entry_RN, token_row_T,
                                                                                  w_TI, n_visible_T, pool_scale_P)


def candidate_blocks(score_TN, n_visible_T, topk_blocks: int, block: int):
    return _pick("candidate_blocks", indexer_topk_ref.candidate_blocks_ref)(score_TN, n_visible_T, topk_blocks, block)


def topk_positions(score_TN, k: int):
    return _pick("topk_positions", indexer_topk_ref.topk_positions_ref)(score_TN, k)


def sinkhorn_iterate(comb_TCC, n: int, eps: float):
    """``n`` mHC Sinkhorn steps (row then column normalisation) on fp32 ``[T, C, C]``."""
    return _pick("sinkhorn_iterate", sinkhorn_ref.sinkhorn_iterate_ref)(comb_TCC, n, eps)


def moe_experts(x_TD, idx_TX, weight_TX, w1, w2, w3, fmt: str, swiglu_limit: float, n_experts: int):
    return _pick("moe_experts", moe_gmm_ref.moe_experts_ref)(x_TD, idx_TX, weight_TX, w1, w2, w3, fmt,
                                                             swiglu_limit, n_experts)
