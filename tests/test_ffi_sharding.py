"""kernels_ascend's FFI ops with operands sharded on an 8-device CPU mesh: inside ``shard_map``
(tokens split over the devices, pools and experts replicated), under plain ``jit`` with
sharded operands (GSPMD runs an unpartitionable custom call on replicated operands), and the
MoE through ``ops`` on a context mesh (experts split, ``moe_ep.py``). Each compares with the
single-device reference (tolerances: tests/test_ffi_ops.py). Runs in a subprocess: the device
count is fixed when the backend starts."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

N_DEV = 8

_SCRIPT = textwrap.dedent(r"""
    import sys
    sys.path.insert(0, {tests_dir!r})
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from ffi_cases import attention_case, moe_case, pool_case
    from test_ffi_ops import close_bf16
    from deepinfer_jax.kernels_ascend import kernels
    from deepinfer_jax.kernels_pallas import indexer_topk_ref, moe_gmm_ref, ops, sinkhorn_ref, sparse_attention_ref

    assert jax.device_count() == {n_dev}, jax.devices()
    K = kernels.kernels_for("cpu")
    mesh = jax.make_mesh(({n_dev},), ("d",))
    rng = np.random.default_rng(0)
    T = 2 * {n_dev} + 0  # two tokens a device

    def smap(f, in_specs, out_specs=P("d")):
        g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs))

        def run(*args):  # operands placed as the specs say (tokens split, the rest replicated)
            placed = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), args, tuple(in_specs),
                                  is_leaf=lambda x: isinstance(x, P))
            return g(*placed)
        return run

    q, pools, idxs, sink = attention_case(rng, T, 4, 64, (70, 5), (90, 11))
    f = smap(lambda q, p, i, s: K["sparse_attention"](q, p, i, s, 0.125),
             (P("d"), (P(), P()), (P("d"), P("d")), P()))
    ref = sparse_attention_ref.sparse_attention_ref(q, pools, idxs, sink, 0.125)
    close_bf16(f(q, pools, idxs, sink), ref, 2 ** -6, 0.01, "shard_map sparse_attention")

    qi, pool, entry, row, w, nv = pool_case(rng, T, 4, 120, 3, 40, 64)
    f = smap(lambda *a: K["indexer_scores_pool"](*a), (P("d"), P(), P(), P("d"), P("d"), P("d")))
    ref = indexer_topk_ref.indexer_scores_pool_ref(qi, pool, entry, row, w, nv)
    close_bf16(f(qi, pool, entry, row, w, nv), ref, 2 ** -5, 0.02, "shard_map indexer_scores_pool")
    f = smap(lambda s: K["topk_positions"](s, 16), (P("d"),))
    np.testing.assert_array_equal(f(ref), indexer_topk_ref.topk_positions_ref(ref, 16))
    f = smap(lambda s, n: K["candidate_blocks"](s, n, 2, 8), (P("d"), P("d")))
    np.testing.assert_array_equal(f(ref, nv), indexer_topk_ref.candidate_blocks_ref(ref, nv, 2, 8))

    c = jnp.asarray(rng.random((T, 4, 4)) + 0.01, jnp.float32)
    f = smap(lambda c: K["sinkhorn_iterate"](c, 19, 1e-6), (P("d"),))
    np.testing.assert_allclose(f(c), sinkhorn_ref.sinkhorn_iterate_ref(c, 19, 1e-6), rtol=1e-5, atol=1e-7)

    E = 16
    x, idx, g, w1, w2, w3 = moe_case(rng, "fp8", T, 3, 64, 64, E)
    ref = moe_gmm_ref.moe_experts_ref(x, idx, g, w1, w2, w3, "fp8", 7.0, E)
    f = smap(lambda x, i, g, w1, w2, w3: K["moe_experts"](x, i, g, w1, w2, w3, "fp8", 7.0, E),
             (P("d"), P("d"), P("d"), (P(), P()), (P(), P()), (P(), P())))
    close_bf16(f(x, idx, g, w1, w2, w3), ref, 2 ** -4, 0.05, "shard_map moe_experts")

    # plain jit on sharded operands: GSPMD gathers them for the custom call
    tok = NamedSharding(mesh, P("d"))
    xs, ids, gs = (jax.device_put(a, tok) for a in (x, idx, g))
    y = jax.jit(lambda x, i, g: K["moe_experts"](x, i, g, w1, w2, w3, "fp8", 7.0, E))(xs, ids, gs)
    close_bf16(y, ref, 2 ** -4, 0.05, "jit sharded moe_experts")

    # through ops with a context mesh: experts split over the devices (moe_ep), psum of the rows
    w_ep = tuple(tuple(jax.device_put(a, NamedSharding(mesh, P("d"))) for a in w) for w in (w1, w2, w3))
    with ops.use_backend("ffi"), jax.set_mesh(mesh):
        y = jax.jit(lambda x, i, g, w1, w2, w3: ops.moe_experts(x, i, g, w1, w2, w3, "fp8", 7.0, E))(x, idx, g, *w_ep)
    close_bf16(y, ref, 2 ** -4, 0.05, "ops.moe_experts on a mesh (ffi per device)")
    print("OK")
""")


def test_ffi_ops_sharded_on_8_cpu_devices():
    import os

    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={N_DEV}"])
    env["JAX_PLATFORMS"] = "cpu"
    script = _SCRIPT.format(tests_dir=str(Path(__file__).parent), n_dev=N_DEV)
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout[-3000:] + r.stderr[-5000:]
