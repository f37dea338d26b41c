"""Random model weights drawn on the device (``EngineConfig.load_format="dummy"``, benchmarks).

``random_model_on_device(cfg, seed, mesh)`` builds ``DeepseekV41ForCausalLM`` with every
parameter drawn by ``jax.random`` on the device: seconds, where writing and reading a 6 GiB
random checkpoint through the host (``checkpoint/random_checkpoint.py``) takes minutes. The values are not
the random checkpoint's (those are numpy draws, rounded through the file formats); they depend
only on (seed, the parameter's position in the model's flat state, its shape and dtype).

With a ``mesh`` every parameter is drawn straight into the sharding ``load_model`` gives it
(``sharding/partition.py: state_shardings``), so no device holds a full copy of a sharded
weight; JAX's partitionable threefry makes the values the same as without a mesh.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from deepinfer_jax.models.weights import abstract_model, param_path_name

__all__ = ["random_model_on_device", "draw_rule"]


def draw_rule(name: str, shape: tuple, dtype) -> str:
    """How parameter ``name`` is drawn: "scale" (ue8m0 block scales), "bytes" (fp4 codes),
    "fp8", "one" (norm weights and 1-D scales) or "normal" (everything else)."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.uint8:
        return "scale" if name.endswith("scale") else "bytes"
    if dtype == jnp.float8_e4m3fn:
        return "fp8"
    if len(shape) == 1 and (name.endswith(("norm.weight", "_scale")) or "norm" in name):
        return "one"
    return "normal"


def _draw(k, shape, dtype, rule):
    if rule == "scale":
        return jax.random.randint(k, shape, 119, 123).astype(dtype)
    if rule == "bytes":
        return jax.random.randint(k, shape, 0, 256).astype(dtype)
    x = jax.random.normal(k, shape, jnp.float32)
    if rule == "one":
        return (1.0 + 0.1 * x).astype(dtype)
    if rule == "fp8":
        return jnp.clip(x, -6, 6).astype(dtype)
    return (x * shape[-1] ** -0.5 if len(shape) >= 2 else 0.5 * x).astype(dtype)


@functools.lru_cache(maxsize=None)
def _drawer(sharding):
    """The jitted draw for one output sharding (None: the default device); shapes, dtypes and
    rules are static, so parameters of one shape share a compile."""
    return jax.jit(_draw, static_argnums=(1, 2, 3), out_shardings=sharding)


def random_model_on_device(cfg, seed: int = 0, mesh=None):
    """The model with every parameter drawn on the device. Distributions only need to keep the
    forward finite and the routing spread: weights ~ N(0, 1/fan_in), norms and scales near 1,
    ue8m0 block scales 2^-8..2^-5, fp4 bytes uniform (every e2m1 code), fp8 weights N(0, 1)
    clipped to +-6. ``mesh``: place each parameter as ``load_model(..., mesh=mesh)`` does."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"random_model_on_device: seed={seed!r}: must be an int >= 0")
    graphdef, abstract = abstract_model(cfg)
    shardings = {}
    if mesh is not None:
        from deepinfer_jax.sharding.partition import flat_shardings, state_shardings

        shardings = flat_shardings(state_shardings(abstract, mesh))
    key = jax.random.key(seed, impl="threefry2x32")  # the default impl, fixed: same values under any config
    values = []
    for i, (path, var) in enumerate(nnx.to_flat_state(abstract)):
        shape, dtype = tuple(var.shape), jnp.dtype(var.dtype)
        rule = draw_rule(param_path_name(path), shape, dtype)
        arr = _drawer(shardings.get(path))(jax.random.fold_in(key, i), shape, dtype, rule)
        values.append((path, var.replace(arr)))
    return nnx.merge(graphdef, nnx.from_flat_state(values))
