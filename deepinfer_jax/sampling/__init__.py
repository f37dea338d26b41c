"""Sampling: per-request ``SamplingParams`` (vLLM-compatible, ``params.py``, no JAX), the jitted
on-device sampler (``sampler.py``) and the jitted verifier of speculative drafts
(``spec_verify.py``). Names are imported lazily so that the host side can use ``SamplingParams``
without importing JAX."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "SamplingParams": "params", "sampling_params_from_dict": "params",
    "SampleRow": "sampler", "SamplerOutput": "sampler", "SamplingBatch": "sampler",
    "build_sampling_batch": "sampler", "min_tokens_banned_ids": "sampler", "sample": "sampler",
    "StructuredOutput": "grammar_spec", "StructuredOutputsParams": "grammar_spec",
    "SpecVerifyOutput": "spec_verify", "verify_drafts": "spec_verify",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"deepinfer_jax.sampling.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'deepinfer_jax.sampling' has no attribute {name!r}")
