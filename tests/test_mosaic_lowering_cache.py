"""``kernels_pallas/mosaic_lowering_cache``: step programs lowered for an SM90 GPU (on this host,
nothing compiled) carry the same Mosaic GPU kernels with the memo as without it, while the memo
serves the kernel calls that repeat across step variants."""

from __future__ import annotations

import os
import re
import sys

import jax
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))

from gpu_lowering_profile import as_if_on_an_h200, lower_variant  # noqa: E402

from deepinfer_jax.base.scheduler_output import SchedulerOutput  # noqa: E402
from deepinfer_jax.entrypoints.llm import LLM  # noqa: E402
from deepinfer_jax.kernels_pallas import mosaic_lowering_cache as mlc  # noqa: E402
from deepinfer_jax.models.registry import DEFAULT_MODEL  # noqa: E402


def kernel_texts(runner, variants) -> list[str]:
    """Per variant, per Mosaic GPU custom call of its lowered step: the kernel module's text
    without debug locations and without JAX's dump file name (a global counter)."""
    from jax._src.interpreters import mlir as jax_mlir
    from jax._src.lib.mlir import ir
    from jax.experimental.mosaic import gpu as mgpu

    empty = SchedulerOutput(step_id=-1, rows=[], preempted=[], cache_hit_tokens=0, queue_wait=[])
    out = []
    for v in variants:
        fn, args, kw = runner.step_call(*runner.step_inputs(empty, *v), prompt_lp=False)
        with jax.set_mesh(runner.trace_mesh):
            module = fn.trace(*args, **kw).lower(lowering_platforms=("cuda",)).compiler_ir("stablehlo")
        calls = []

        def visit(op):
            if op.name == "stablehlo.custom_call" and "mosaic_gpu" in str(op.attributes["call_target_name"]):
                calls.append(ir.StringAttr(op.attributes["mhlo.backend_config"]["module"]).value_bytes)
            for region in op.regions:
                for block in region.blocks:
                    for inner in block.operations:
                        visit(inner)

        visit(module.operation)
        ctx = jax_mlir.make_ir_context()
        mgpu.dialect.register_dialect(ctx)
        ctx.allow_unregistered_dialects = True  # the serialised form's versioned ops
        for blob in calls:
            text = ir.Module.parse(blob, context=ctx).operation.get_asm(enable_debug_info=False)
            out.append(re.sub(r'mosaic_gpu\.dump_basename = "[^"]*"', "", text))
    return out


@pytest.fixture
def restore_memo():
    yield
    mlc.install()  # as the GPU kernels' loading leaves it
    mlc.clear()


def test_memo_gives_the_kernels_jax_lowers_and_serves_repeats(restore_memo):
    llm = LLM(DEFAULT_MODEL, progress=False, precompile=False, spec_decode="dspark", max_num_seqs=8,
              max_num_batched_tokens=48, token_buckets=(8, 48), decoder_buckets=(48,))
    variants = llm.runner.variants()
    assert len(variants) == 2
    with as_if_on_an_h200():
        mlc.uninstall()
        jax.clear_caches()
        ref = kernel_texts(llm.runner, variants)
        assert mlc.install()
        jax.clear_caches()
        got = kernel_texts(llm.runner, variants)
        stats = mlc.stats()
    # the shipped model's step: the backbone MoE and the DSpark stages' MoE, two kernels each
    assert len(ref) == 8, len(ref)
    assert got == ref
    # JAX lowered each distinct kernel once; the rest came from the memo (the stages' MoE rows do
    # not depend on the token bucket, so the second variant reuses them)
    assert stats["misses"] == len(set(ref)) < len(ref), (stats, len(set(ref)))
    assert stats["hits"] >= len(ref) - len(set(ref)), stats


@pytest.mark.parametrize("memo", [False, True], ids=["memo_off", "memo_on"])
def test_step_programs_do_not_depend_on_what_the_process_lowered_before(restore_memo, memo):
    """A step program's text is its key in the persistent compilation cache: lowered after other
    kernels, in another order, it must be the same text, or a warm start misses the cache. JAX
    names each kernel from a process-wide counter; the wrapper names it after its content."""
    llm = LLM(DEFAULT_MODEL, progress=False, precompile=False, max_num_seqs=8, max_num_batched_tokens=48,
              token_buckets=(8, 48), decoder_buckets=(48,))
    variants = llm.runner.variants()
    assert len(variants) == 2
    with as_if_on_an_h200():
        assert mlc.install(memo=memo)
        programs = []
        for order in (variants, variants[::-1]):
            mlc.clear()
            jax.clear_caches()  # every kernel lowered afresh
            programs.append({v: lower_variant(llm.runner, *v)[2] for v in order})
    assert programs[0] == programs[1]
    # where the name is serialised (jax 0.11; 0.12 leaves it out of the kernel it serialises)
    names = re.findall(r"dump_basename\\00(kernel_\w+)\\00", programs[0][variants[0]])
    assert all(re.fullmatch(r"kernel_[0-9a-f]{16}", n) for n in names), names
