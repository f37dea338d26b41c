"""MoE with sqrtsoftplus routing, selection bias, clamped SwiGLU experts and one shared expert.

Gate: ``s = sqrt(softplus(x W_g^T))`` (fp32); experts = top-k of ``s + bias`` (the bias only
chooses); weights = ``s[experts] / (sum + 1e-20) * routed_scaling_factor``.
Expert e: ``w2(silu(min(w1 x, L)) * clip(w3 x, -L, L) * weight_e)``. Output =
sum of routed outputs (fp32, ascending expert id, as the reference adds them) + shared(x).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from deepinfer_jax.base import batch_invariant as bi
from deepinfer_jax.kernels_pallas import ops
from deepinfer_jax.sharding import expert_replicas
from deepinfer_jax.layers.linear import Linear, _storage, matmul_f32


def softplus_torch(z: jax.Array) -> jax.Array:
    """torch's softplus (beta 1, threshold 20)."""
    return jnp.where(z > 20, z, jnp.log1p(jnp.exp(jnp.minimum(z, 20))))


class Gate(nnx.Module):
    def __init__(self, dim: int, n_experts: int, topk: int, route_scale: float, norm_topk: bool):
        self.topk, self.route_scale, self.norm_topk = topk, route_scale, norm_topk
        self.weight = nnx.Param(jnp.zeros((n_experts, dim), jnp.bfloat16), logical_axes=(None, None))
        self.bias = nnx.Param(jnp.zeros((n_experts,), jnp.float32), logical_axes=(None,))

    def __call__(self, x_TD: jax.Array):
        scores = jnp.sqrt(softplus_torch(matmul_f32(x_TD, self.weight[...].T)))
        _, idx = jax.lax.top_k(scores + self.bias[...], self.topk)
        w = jnp.take_along_axis(scores, idx, axis=-1)
        if self.norm_topk and self.topk > 1:
            w = w / (bi.row_sum(w, axis=-1, keepdims=True) + jnp.float32(1e-20))
        return w * jnp.float32(self.route_scale), idx


class ExpertProj(nnx.Module):
    """One projection (w1, w2 or w3) of all routed experts, stacked: ``[E, out, in]`` storage."""

    def __init__(self, n_experts: int, in_features: int, out_features: int, fmt: str):
        self.fmt = fmt
        wshape, wdtype, sshape = _storage(fmt, out_features, in_features)
        self.weight = nnx.Param(jnp.zeros((n_experts, *wshape), wdtype), logical_axes=("expert", None, None))
        if sshape is not None:
            self.scale = nnx.Param(jnp.full((n_experts, *sshape), 127, jnp.uint8),
                                   logical_axes=("expert", None, None))

    def parts(self):
        return self.weight[...], (self.scale[...] if hasattr(self, "scale") else None)


class SharedExpert(nnx.Module):
    def __init__(self, dim: int, inter: int, fmt: str, swiglu_limit: float):
        self.limit = swiglu_limit
        self.w1 = Linear(dim, inter, fmt)
        self.w2 = Linear(inter, dim, fmt)
        self.w3 = Linear(dim, inter, fmt)

    def __call__(self, x_TD: jax.Array) -> jax.Array:
        gate = self.w1(x_TD).astype(jnp.float32)
        up = self.w3(x_TD).astype(jnp.float32)
        if self.limit > 0:
            up = jnp.clip(up, -self.limit, self.limit)
            gate = jnp.minimum(gate, self.limit)
        return self.w2((jax.nn.silu(gate) * up).astype(jnp.bfloat16))


class Experts(nnx.Module):
    def __init__(self, n_experts: int, dim: int, inter: int, fmt: str):
        self.n, self.fmt = n_experts, fmt
        self.w1 = ExpertProj(n_experts, dim, inter, fmt)
        self.w2 = ExpertProj(n_experts, inter, dim, fmt)
        self.w3 = ExpertProj(n_experts, dim, inter, fmt)


class MoE(nnx.Module):
    def __init__(self, cfg, layer: int, dense_fmt: str, expert_fmt: str):
        n_experts, topk = cfg.moe_experts(layer)
        D, F = cfg.hidden_size, cfg.moe_intermediate_size
        self.layer = layer
        self.n_experts, self.limit = n_experts, cfg.swiglu_limit
        self.gate = Gate(D, n_experts, topk, cfg.routed_scaling_factor, cfg.norm_topk_prob)
        self.experts = Experts(n_experts, D, F, expert_fmt)
        self.shared_experts = SharedExpert(D, F, dense_fmt, cfg.swiglu_limit)

    def __call__(self, x_TD: jax.Array, taps: dict | None = None, tag: str = "") -> jax.Array:
        weights_TX, idx_TX = self.gate(x_TD)
        if taps is not None:
            taps[f"gate{tag}_indices"] = idx_TX
            taps[f"gate{tag}_weights"] = weights_TX
        e = self.experts
        # redundant experts (EPLB, sharding/expert_replicas.py): the same logical routing on the
        # engine's physical slots; every replica holds its expert's weights, so y is unchanged
        phys_TX, n_physical = expert_replicas.route(self.layer, idx_TX, self.n_experts)
        y_TXD = ops.moe_experts(x_TD, phys_TX, weights_TX, e.w1.parts(), e.w2.parts(), e.w3.parts(),
                                e.fmt, self.limit, n_physical or self.n_experts)
        # the reference adds routed outputs into an fp32 buffer in ascending expert order
        order = jnp.argsort(idx_TX, axis=-1)
        y_TXD = jnp.take_along_axis(y_TXD, order[..., None], axis=1).astype(jnp.float32)
        y = y_TXD[:, 0]
        for i in range(1, y_TXD.shape[1]):
            y = y + y_TXD[:, i]
        y = y + self.shared_experts(x_TD).astype(jnp.float32)
        return y.astype(x_TD.dtype)
