"""scripts/gpu_lowering_profile.py: an engine's GPU step lowered for CUDA on a host without a GPU."""

from __future__ import annotations

import json

import jax

from conftest import load_script


def test_step_lowered_for_cuda_with_the_gpu_kernels(tmp_path):
    """The tiny model's step lowers for CUDA with the Triton kernels chosen (the patch makes the
    ops pick their GPU kernels), and nothing leaks: after the run the host is a CPU again."""
    prof = load_script("gpu_lowering_profile")
    out = tmp_path / "lowering.json"
    assert prof.main(["--model", "v41-tiny", "--variants", "1", "--out", str(out)]) == 0
    [row] = json.loads(out.read_text())["rows"]
    assert row["triton_sites"] > 0 and row["lower_s"] > 0
    assert jax.default_backend() == "cpu"
