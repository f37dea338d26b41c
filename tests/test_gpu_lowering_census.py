"""``scripts/gpu_lowering_profile.op_census``: operations of a traced program per function of the
package that emitted them, nested jits walked through, scan bodies counted per iteration."""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))

from gpu_lowering_profile import op_census  # noqa: E402

from deepinfer_jax.layers.norms import rms_norm  # noqa: E402


def test_census_names_the_package_function_and_counts_scan_iterations():
    x = jax.random.normal(jax.random.key(1), (4, 32), jnp.float32)
    w = jax.random.normal(jax.random.key(2), (32,), jnp.float32)

    def once(x):
        return jax.jit(rms_norm, static_argnums=2)(x, w, 1e-6)

    def four(x):
        return jax.lax.scan(lambda c, _: (rms_norm(c, w, 1e-6), None), x, None, length=4)[0]

    one = op_census(jax.make_jaxpr(once)(x))
    # the innermost package frame owns an op: rms_norm's elementwise ops, row_mean's reduction
    norm = next(k for k in one if k.endswith("layers/norms.py:rms_norm"))
    mean = next(k for k in one if k.endswith("base/batch_invariant.py:row_mean"))
    assert one[norm][0] >= 3 and one[norm][1] == 0
    assert one[mean][1] >= 1
    four_c = op_census(jax.make_jaxpr(four)(x))
    for k in (norm, mean):
        assert four_c[k] == [4 * one[k][0], 4 * one[k][1]]
    # the package's functions come first by unfused ops; code outside it is named as such
    assert all(k.endswith(".py:" + k.split(":")[-1]) or k == "(outside the package)" for k in four_c)
