"""Sampling: per-request ``SamplingParams`` (vLLM-compatible) and the jitted on-device sampler."""

from deepinfer_jax.sampling.params import SamplingParams, sampling_params_from_dict
from deepinfer_jax.sampling.sampler import (
    SampleRow,
    SamplerOutput,
    SamplingBatch,
    build_sampling_batch,
    min_tokens_banned_ids,
    sample,
)

__all__ = [
    "SampleRow",
    "SamplerOutput",
    "SamplingBatch",
    "SamplingParams",
    "build_sampling_batch",
    "min_tokens_banned_ids",
    "sample",
    "sampling_params_from_dict",
]
