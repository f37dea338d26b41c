"""Redundant experts (``sharding/expert_replicas.py``) with EPLB's placement: on a skewed routing
the busiest rank's measured load falls after a rebalance, and the routed experts' output is the
same, bit for bit, whether tokens run on logical experts or on any placement's replicas."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.kernels_pallas import moe_gmm_ref
from deepinfer_jax.sharding import eplb
from deepinfer_jax.sharding.expert_replicas import physical_ids, physical_load, physical_stack

E, X, D, F = 8, 2, 64, 32
R, GPUS = 12, 4          # 4 redundant slots, 3 slots per rank


def skewed_routing(rng, T: int) -> np.ndarray:
    """Top-X logical experts per token drawn from a skewed distribution (experts 0-1 hot)."""
    p = np.asarray([0.3, 0.25, 0.1, 0.1, 0.08, 0.07, 0.05, 0.05])
    return np.stack([rng.choice(E, size=X, replace=False, p=p) for _ in range(T)]).astype(np.int32)


def rank_loads(phys_TX, num_gpus: int) -> np.ndarray:
    load = np.asarray(physical_load(jnp.asarray(phys_TX), R))
    return load.reshape(num_gpus, -1).sum(1)


def log2phy_of(phy2log: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    cnt = np.bincount(phy2log, minlength=E)
    l2p = np.full((E, cnt.max()), -1, np.int32)
    fill = np.zeros(E, np.int64)
    for r, e in enumerate(phy2log):
        l2p[e, fill[e]] = r
        fill[e] += 1
    return l2p, cnt.astype(np.int32)


def test_physical_ids_spread_entries_evenly_over_replicas():
    phy2log = np.asarray([0, 1, 2, 0, 0, 3], np.int32)   # expert 0 has three replicas
    l2p, cnt = log2phy_of(phy2log)
    idx = jnp.asarray(np.zeros((6, 2), np.int32).tolist() + [[1, -1], [4, 3]], jnp.int32)
    phys = np.asarray(physical_ids(idx, jnp.asarray(l2p), jnp.asarray(cnt)))
    assert sorted(np.bincount(phys[:6].reshape(-1), minlength=6)[[0, 3, 4]]) == [4, 4, 4]
    assert phys[6].tolist() == [1, -1]                   # -1 stays -1
    assert phys[7, 0] == -1 and phys[7, 1] == 5          # 4 >= E of this placement (4 experts): off


def test_rebalance_lowers_the_busiest_rank_and_keeps_the_output():
    rng = np.random.default_rng(0)
    T = 96
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.bfloat16)
    wt = jnp.asarray(rng.uniform(0.1, 1, (T, X)), jnp.float32)
    ws = tuple((jnp.asarray(rng.standard_normal((E, o, k)) / np.sqrt(k), jnp.bfloat16), None)
               for o, k in ((F, D), (D, F), (F, D)))
    window = skewed_routing(rng, 512)   # the load window the placement is computed from
    idx = jnp.asarray(skewed_routing(rng, T))

    # before: no EPLB (slot e < E holds expert e, spares replicate experts 4-7: ranks of 3 slots)
    before = np.concatenate([np.arange(E), np.arange(4, E)]).astype(np.int32)
    counts = np.bincount(window.reshape(-1), minlength=E)[None].astype(np.float64)
    after, _, _ = eplb.rebalance_experts(counts, R, 1, 1, GPUS)
    after = np.asarray(after[0], np.int32)

    ref = np.asarray(moe_gmm_ref.moe_experts_ref(x, idx, wt, *ws, "bf16", 0.0, E), np.float32)
    loads = {}
    for name, phy2log in (("before", before), ("after", after)):
        l2p, cnt = log2phy_of(phy2log)
        phys = physical_ids(idx, jnp.asarray(l2p), jnp.asarray(cnt))
        stack = tuple(physical_stack(w, jnp.asarray(phy2log)) for w in ws)
        out = np.asarray(moe_gmm_ref.moe_experts_ref(x, phys, wt, *stack, "bf16", 0.0, R), np.float32)
        np.testing.assert_array_equal(out, ref, err_msg=f"placement {name}")
        loads[name] = rank_loads(phys, GPUS)
    assert loads["before"].sum() == loads["after"].sum() == T * X
    # measured on this batch (not the window the placement came from): the busiest rank
    # carries 2.5x the even share without EPLB and falls to within 1.4x of it
    even = T * X / GPUS
    assert loads["before"].max() > 2 * even, loads
    assert loads["after"].max() < 0.6 * loads["before"].max(), loads
    assert loads["after"].max() <= 1.4 * even, loads


def test_physical_stack_copies_the_logical_weights():
    w = jnp.arange(4 * 3, dtype=jnp.float32).reshape(4, 3)
    got = physical_stack((w, None), jnp.asarray([2, 0, 2, 1, 3]))
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(w)[[2, 0, 2, 1, 3]])
    assert got[1] is None


@pytest.mark.parametrize("num_physical", [5, 9])
def test_physical_load_counts_entries(num_physical):
    phys = jnp.asarray([[0, 1], [1, -1], [num_physical - 1, 0]], jnp.int32)
    load = np.asarray(physical_load(phys, num_physical))
    assert load.sum() == 5 and load[0] == 2 and load[1] == 2 and load[num_physical - 1] == 1


def test_step_placement_arrays_are_consistent():
    """``initial_placement`` / ``placement_arrays`` (the step's input): every slot's expert lists
    it among its replicas, counts add up to the slots, log2phy is padded to R - E + 1."""
    from deepinfer_jax.sharding.eplb import rebalance_experts
    from deepinfer_jax.sharding.expert_replicas import initial_placement, placement_arrays, route

    E, R = 8, 12
    rng = np.random.default_rng(2)
    for pl in (initial_placement(3, E, R, (0, 1, 2)),
               placement_arrays(*rebalance_experts(rng.integers(1, 100, (3, E)), R, 1, 1, 4, policy="global"),
                                (0, 1, 2))):
        p2l, l2p, cnt = np.asarray(pl.phy2log_LR), np.asarray(pl.log2phy_LEK), np.asarray(pl.logcnt_LE)
        assert l2p.shape == (3, E, R - E + 1) and (cnt >= 1).all() and (cnt.sum(1) == R).all()
        for li in range(3):
            for e in range(E):
                slots = l2p[li, e, :cnt[li, e]]
                assert (p2l[li, slots] == e).all() and (l2p[li, e, cnt[li, e]:] == -1).all()
    idx = jnp.asarray(rng.integers(0, E, (5, 2)), jnp.int32)
    phys, n = route(0, idx, E)
    assert phys is idx and n is None   # no placement active: the logical ids, unchanged
