"""The table ``kernels_pallas/ops.py`` reads for ``kernels="ffi"``: op name -> implementation,
once the targets of the platform are registered."""

from __future__ import annotations

from typing import Callable

from deepinfer_jax.kernels_ascend import indexer_topk, library, moe_gmm, sinkhorn, sparse_attention
from deepinfer_jax.kernels_ascend.ascend import platform_names

OPS: dict[str, Callable] = {
    "sparse_attention": sparse_attention.sparse_attention,
    "indexer_scores": indexer_topk.indexer_scores,
    "indexer_scores_pool": indexer_topk.indexer_scores_pool,
    "candidate_blocks": indexer_topk.candidate_blocks,
    "topk_positions": indexer_topk.topk_positions,
    "sinkhorn_iterate": sinkhorn.sinkhorn_iterate,
    "moe_experts": moe_gmm.moe_experts,
}


def supports(platform: str) -> bool:
    """Whether ffi targets exist for ``platform`` (CPU test build, or an Ascend platform)."""
    return platform == "cpu" or platform in platform_names.ASCEND_PLATFORMS


def kernels_for(platform: str) -> dict[str, Callable]:
    """Register the targets of ``platform`` (raises ``library.FfiUnavailable`` with what to
    install when they are not built) and return the op table."""
    library.register(platform)
    return OPS
