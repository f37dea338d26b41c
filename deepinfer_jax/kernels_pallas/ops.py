"""The hot ops behind one function each; the model calls only these.

Each op has a pure-jnp reference (``*_ref.py`` beside this file: the oracle for tests and the
path on CPU). Pallas kernels (NVIDIA GPU) and Ascend custom calls plug in here per platform.
Until a kernel is registered for an op, every platform runs the reference.

Which one runs is decided when a step is traced: ``use_backend(name)`` around the trace (the
engine's runner does this with its own ``kernels`` setting, which is also part of its compiled
step's cache key), else the process default: ``$DEEPINFER_KERNELS`` or ``set_backend``.
``"reference"`` forces the references anywhere. ``"ffi"`` routes every op through the XLA FFI
custom calls of ``kernels_ascend`` (its C++ CPU targets on CPU, its device targets on an Ascend
platform; loaded lazily by name, one way: ``kernels_ascend`` never imports this room); when they are
not built it raises ``kernels_ascend.library.FfiUnavailable`` saying what to install. ``full_rows(B, L)`` around a trace says the step's
tokens are ``B`` whole sequences of ``L`` tokens from position 0 (training): the references of
``sparse_attention`` and ``indexer_scores_pool`` then take their dense per-row forms
(``full_rows_ref.py``: no per-token key copies, no scatter-add gradients).

``$DEEPINFER_KERNELS_OFF`` (or ``set_disabled``): a comma-separated list of op names (``OPS``)
whose references run even where a kernel is registered: to take one kernel out of a comparison,
or to rule it out when numbers look wrong.

A kernel that cannot take a call (a non-SM90 GPU, operands on several devices without a context
mesh, a shape it does not tile) runs the reference and says so: ``note_fallback`` logs each
(op, reason) once and counts it per trace (``fallback_counts``, shown in the engine's stats).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import importlib
import logging
import os
import warnings
from typing import Callable

from deepinfer_jax.base import batch_invariant as bi
from deepinfer_jax.kernels_pallas import f32_matmul_ref, full_rows_ref, indexer_topk_ref, moe_gmm_ref, sinkhorn_ref, sparse_attention_ref

BACKENDS = ("auto", "reference", "ffi")
OPS = ("sparse_attention", "indexer_scores", "indexer_scores_pool", "topk_positions", "candidate_blocks",
       "sinkhorn", "sinkhorn_iterate", "f32_matmul", "moe_experts")
_BACKEND = os.environ.get("DEEPINFER_KERNELS", "auto")
_DISABLED: str | frozenset[str] = os.environ.get("DEEPINFER_KERNELS_OFF", "")  # checked on first use
_ACTIVE: contextvars.ContextVar[str | None] = contextvars.ContextVar("deepinfer_kernels", default=None)
_FULL_ROWS: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar("deepinfer_full_rows", default=None)
_FALLBACKS: collections.Counter = collections.Counter()  # (op, reason) -> traced calls
_log = logging.getLogger("deepinfer_jax.kernels")
_KERNELS: dict[tuple[str, str], Callable] = {}  # (op, platform) -> implementation
# Kernel modules imported on first use on their platform; each registers its ops on import.
_KERNEL_MODULES: dict[str, tuple[str, ...]] = {
    "gpu": ("deepinfer_jax.kernels_pallas.sparse_attention", "deepinfer_jax.kernels_pallas.indexer_topk",
            "deepinfer_jax.kernels_pallas.moe_gmm", "deepinfer_jax.kernels_pallas.sinkhorn",
            "deepinfer_jax.kernels_pallas.f32_matmul_bf16x3"),
}
# kernels="ffi": the op table of kernels_ascend (a sibling room, imported by name on first use)
_FFI_MODULE = "deepinfer_jax.kernels_ascend.kernels"
_LOADED: set[str] = set()
_LOAD_ERRORS: dict[str, list[str]] = {}  # platform -> modules that failed to import


def _load_kernels(platform: str) -> None:
    if platform in _LOADED:
        return
    _LOADED.add(platform)
    if platform == "gpu":
        from deepinfer_jax.kernels_pallas import mosaic_lowering_cache

        # kernels named after their content (cacheable programs); one Mosaic GPU lowering per
        # distinct kernel call unless DEEPINFER_MOSAIC_LOWERING_CACHE=0
        mosaic_lowering_cache.install(memo=os.environ.get("DEEPINFER_MOSAIC_LOWERING_CACHE", "1") != "0")
    for mod in _KERNEL_MODULES.get(platform, ()):
        try:
            importlib.import_module(mod)
        except Exception as e:  # a broken kernel module must not take the reference path down
            _LOAD_ERRORS.setdefault(platform, []).append(mod.rsplit(".", 1)[-1])
            warnings.warn(f"kernel module {mod} not loaded ({type(e).__name__}: {e}); "
                          "using the references", RuntimeWarning, stacklevel=3)


def _checked(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"kernel backend {name!r}: expected one of {BACKENDS}")
    return name


def default_backend() -> str:
    """The process default: ``set_backend``'s value, else ``$DEEPINFER_KERNELS``, else ``auto``."""
    return _checked(_BACKEND)


def set_backend(name: str) -> None:
    """Process default: ``auto`` (kernel where one is registered for the platform),
    ``reference`` or ``ffi`` (the kernels_ascend custom calls). Code traced inside ``use_backend`` is not affected."""
    global _BACKEND
    _BACKEND = _checked(name)


def set_disabled(names) -> None:
    """Ops (names from ``OPS``) that run their references whatever the backend; replaces
    ``$DEEPINFER_KERNELS_OFF``. Takes effect in steps traced afterwards."""
    global _DISABLED
    _DISABLED = _checked_ops(names, "set_disabled")


def _checked_ops(names, where: str) -> frozenset[str]:
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",")]
    names = frozenset(n for n in names if n)
    unknown = sorted(names - set(OPS))
    if unknown:
        raise ValueError(f"{where}: unknown op(s) {unknown}; expected names from {OPS}")
    return names


def disabled_ops() -> frozenset[str]:
    global _DISABLED
    if isinstance(_DISABLED, str):
        _DISABLED = _checked_ops(_DISABLED, "DEEPINFER_KERNELS_OFF")
    return _DISABLED


@contextlib.contextmanager
def use_backend(name: str | None):
    """Ops traced inside pick kernels by ``name`` (``None``: the process default)."""
    token = _ACTIVE.set(None if name is None else _checked(name))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def full_rows(batch: int, seq_len: int):
    """Ops traced inside see ``batch`` whole sequences of ``seq_len`` tokens (see the module doc)."""
    token = _FULL_ROWS.set((int(batch), int(seq_len)))
    try:
        yield
    finally:
        _FULL_ROWS.reset(token)


def current_backend() -> str:
    return _ACTIVE.get() or default_backend()


def note_fallback(op: str, reason: str) -> None:
    """A kernel of ``op`` runs the reference for ``reason``: logged once, counted per trace."""
    key = (op, reason)
    if key not in _FALLBACKS:
        _log.warning("kernel for %s not used, running the jnp reference: %s", op, reason)
    _FALLBACKS[key] += 1


def fallback_counts() -> dict[str, int]:
    """``"op: reason" -> traced calls that fell back`` since the process started."""
    return {f"{op}: {reason}": n for (op, reason), n in sorted(_FALLBACKS.items())}


def register_kernel(op: str, platform: str, fn: Callable) -> None:
    _KERNELS[(op, platform)] = fn


def _ffi_pick(op: str, ref: Callable, platform: str) -> Callable:
    ffi = importlib.import_module(_FFI_MODULE)
    if not ffi.supports(platform):
        note_fallback(op, f"no ffi custom-call targets for platform {platform} (cpu and Ascend only)")
        return ref
    fn = ffi.kernels_for(platform).get(op)  # raises FfiUnavailable with what to install
    if fn is None:  # an op with no custom call (f32_matmul: XLA's own GEMM is the target's)
        return ref
    return _experts_parallel(fn) if op == "moe_experts" else fn


def _experts_parallel(local_fn: Callable) -> Callable:
    """A custom call's MoE on a context mesh of several devices: per device over its local experts
    (``moe_ep.py``), as the GPU kernel runs; GSPMD would gather every expert for a custom call."""
    def run(*args):
        from deepinfer_jax.kernels_pallas import moe_ep

        mesh = moe_ep.context_mesh()
        if mesh is not None and mesh.size > 1:
            return moe_ep.moe_experts_ep(local_fn, *args, mesh=mesh)
        return local_fn(*args)
    return run


def _pick(op: str, ref: Callable) -> Callable:
    backend = current_backend()
    if backend == "reference" or op in disabled_ops():
        return ref
    import jax

    platform = jax.default_backend()
    if backend == "ffi":
        return _ffi_pick(op, ref, platform)
    _load_kernels(platform)
    fn = _KERNELS.get((op, platform))
    if fn is None:
        if _LOAD_ERRORS.get(platform):
            note_fallback(op, f"kernel modules {_LOAD_ERRORS[platform]} did not load on {platform}")
        return ref
    return fn


def sparse_attention(q_THA, pools, idxs, sink_H, scale: float, exact: bool = True):
    """Sparse MQA attention with sink over gathered entries of ``pools`` (see the reference)."""
    rows = _FULL_ROWS.get()
    if rows is not None and current_backend() == "reference":
        return full_rows_ref.sparse_attention_rows(q_THA, pools, idxs, sink_H, scale, rows)
    fn = _pick("sparse_attention", sparse_attention_ref.sparse_attention_ref)
    if fn is sparse_attention_ref.sparse_attention_ref and bi.enabled():  # per token: on fixed token tiles
        n = len(idxs)
        return bi.rowwise(lambda q, *a: fn(q, a[n:-1], a[:n], a[-1], scale, exact), q_THA, *idxs,
                          consts=(*pools, sink_H))
    return fn(q_THA, pools, idxs, sink_H, scale, exact)


def indexer_scores(q_TIJ, k_TNJ, w_TI, n_visible_T):
    return _pick("indexer_scores", indexer_topk_ref.indexer_scores_ref)(q_TIJ, k_TNJ, w_TI, n_visible_T)


def indexer_scores_pool(q_TIJ, pool_PJ, entry_RN, token_row_T, w_TI, n_visible_T, pool_scale_P=None):
    """``indexer_scores`` with keys ``pool_PJ[entry_RN[token_row_T[t]]]`` read in place (no gather copy);
    with ``pool_scale_P`` the pool holds codes scaled per entry (``quant.pack_index_keys``)."""
    rows = _FULL_ROWS.get()
    if rows is not None and current_backend() == "reference":
        return full_rows_ref.indexer_scores_pool_rows(q_TIJ, pool_PJ, entry_RN, token_row_T, w_TI, n_visible_T,
                                                      pool_scale_P, rows)
    fn = _pick("indexer_scores_pool", indexer_topk_ref.indexer_scores_pool_ref)
    if fn is indexer_topk_ref.indexer_scores_pool_ref and bi.enabled():  # per token: on fixed token tiles
        return bi.rowwise(lambda q, r, w, n, pool, entry, *sc: fn(q, pool, entry, r, w, n, *sc),
                          q_TIJ, token_row_T, w_TI, n_visible_T,
                          consts=(pool_PJ, entry_RN) + (() if pool_scale_P is None else (pool_scale_P,)))
    return fn(q_TIJ, pool_PJ, entry_RN, token_row_T, w_TI, n_visible_T, pool_scale_P)


def candidate_blocks(score_TN, n_visible_T, topk_blocks: int, block: int):
    return _pick("candidate_blocks", indexer_topk_ref.candidate_blocks_ref)(score_TN, n_visible_T, topk_blocks, block)


def topk_positions(score_TN, k: int):
    return _pick("topk_positions", indexer_topk_ref.topk_positions_ref)(score_TN, k)


def sinkhorn_iterate(comb_TCC, n: int, eps: float):
    """``n`` mHC Sinkhorn steps (row then column normalisation) on fp32 ``[T, C, C]``."""
    return _pick("sinkhorn_iterate", sinkhorn_ref.sinkhorn_iterate_ref)(comb_TCC, n, eps)


def sinkhorn(comb_TCC, iters: int, eps: float):
    """The whole mHC Sinkhorn of ``mhc.sinkhorn_split`` on fp32 softmax numerators ``[T, C, C]``:
    the first step (``sinkhorn_ref.first_step``), then ``iters - 1`` steps. A kernel runs both in
    one launch; without one (or with ``sinkhorn_iterate`` switched off) the first step is jnp and
    the steps are ``sinkhorn_iterate``'s."""
    if "sinkhorn_iterate" in disabled_ops():
        return _sinkhorn_steps(comb_TCC, iters, eps)
    return _pick("sinkhorn", _sinkhorn_steps)(comb_TCC, iters, eps)


def _sinkhorn_steps(comb_TCC, iters: int, eps: float):
    return sinkhorn_ref.sinkhorn_ref(comb_TCC, iters, eps, iterate=sinkhorn_iterate)


def f32_matmul(x_TK, w_KN):
    """Full-precision fp32 ``x @ w`` (the fp32 layers: LM head, DSpark head, routers)."""
    return _pick("f32_matmul", f32_matmul_ref.f32_matmul_ref)(x_TK, w_KN)


def moe_experts(x_TD, idx_TX, weight_TX, w1, w2, w3, fmt: str, swiglu_limit: float, n_experts: int):
    fn = _pick("moe_experts", moe_gmm_ref.moe_experts_ref)
    from deepinfer_jax.sharding.manual import manual_axes

    if manual_axes():  # inside the attention-DP step: local experts, explicit exchange (moe_ep.py)
        from deepinfer_jax.kernels_pallas import moe_ep

        return moe_ep.moe_experts_dp(fn, x_TD, idx_TX, weight_TX, w1, w2, w3, fmt, swiglu_limit, n_experts)
    return fn(x_TD, idx_TX, weight_TX, w1, w2, w3, fmt, swiglu_limit, n_experts)
