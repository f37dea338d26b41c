"""deepinfer_jax: a JAX/XLA inference engine for the DeepSeek-V4.1 model family.

Public API (imported lazily, so ``deepinfer_jax.host_scheduler`` stays free of JAX):
``LLM``, ``SamplingParams``, ``StructuredOutputsParams``, ``RequestOutput``, ``CompletionOutput``, ``EngineConfig``.
"""

from __future__ import annotations

import importlib

from deepinfer_jax import xla_numerics as _xla_numerics

_xla_numerics.apply()  # before any JAX backend starts (see xla_numerics.py)

_EXPORTS = {
    "LLM": "deepinfer_jax.entrypoints.llm",
    "SamplingParams": "deepinfer_jax.sampling.params",
    "StructuredOutputsParams": "deepinfer_jax.sampling.grammar_spec",
    "RequestOutput": "deepinfer_jax.engine.outputs",
    "CompletionOutput": "deepinfer_jax.engine.outputs",
    "EngineConfig": "deepinfer_jax.engine_config",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'deepinfer_jax' has no attribute {name!r}")
