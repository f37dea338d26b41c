"""EPLB placement (``deepinfer_jax/sharding/eplb.py``): DeepSeek's README example, the placement
invariants on random instances of both policies, the argument errors, the two building blocks on
hand-checked cases, and the load a user would see on a skewed routing. NumPy only, no JAX."""

from __future__ import annotations

import re

import numpy as np
import pytest

from deepinfer_jax.sharding.eplb import balanced_packing, gpu_loads, rebalance_experts, replicate_experts

# docs/FEATURES.md section 6 (from DeepSeek's EPLB README): hierarchical, R=16, groups=4, nodes=2, gpus=8
README_W = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
            [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]
README_PHY2LOG = [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                  [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]


def identity_placement(weight, num_replicas):
    """The placement without EPLB, same slot count: slot e < E holds expert e, the R - E spare
    slots get one more replica of the hottest experts (hottest first; ties: lower index)."""
    w = np.asarray(weight, np.float64)
    L, E = w.shape
    hot = np.argsort(-w, axis=1, kind="stable")[:, :num_replicas - E]
    phy2log = np.concatenate([np.broadcast_to(np.arange(E), (L, E)), hot], axis=1)
    logcnt = np.ones((L, E), np.int64)
    np.put_along_axis(logcnt, hot, 2, axis=1)
    return phy2log, logcnt


def check_placement(weight, R, G, N, P, policy, out):
    phy2log, log2phy, logcnt = out
    w = np.asarray(weight, np.float64)
    L, E = w.shape
    K = int(logcnt.max())
    assert phy2log.shape == (L, R) and log2phy.shape == (L, E, K) and logcnt.shape == (L, E)
    assert phy2log.dtype == log2phy.dtype == logcnt.dtype == np.int64
    assert (logcnt >= 1).all() and (logcnt.sum(1) == R).all()
    assert ((phy2log >= 0) & (phy2log < E)).all()
    per_gpu = R // P
    for l in range(L):
        # every expert's replicas are all in phy2log, as many as logcnt says
        np.testing.assert_array_equal(np.bincount(phy2log[l], minlength=E), logcnt[l])
        valid = []
        for e in range(E):
            c = logcnt[l, e]
            slots = log2phy[l, e, :c]
            assert (slots >= 0).all() and (phy2log[l, slots] == e).all()
            assert (log2phy[l, e, c:] == -1).all()
            valid.extend(slots.tolist())
        # each slot is named exactly once, and every GPU has R / P of them
        assert sorted(valid) == list(range(R))
        np.testing.assert_array_equal(np.bincount(np.asarray(valid) // per_gpu, minlength=P), [per_gpu] * P)
    used = policy if policy != "auto" else ("hierarchical" if G % N == 0 else "global")
    if used == "hierarchical":
        # a group's replicas never leave its node
        node_of_slot = np.arange(R) // (R // N)
        group_of = phy2log // (E // G)
        for l in range(L):
            for g in range(G):
                assert len(set(node_of_slot[group_of[l] == g].tolist())) == 1
    loads = gpu_loads(w, phy2log, logcnt, P)
    np.testing.assert_allclose(loads.sum(1), w.sum(1))


def test_readme_vector_exact():
    phy2log, log2phy, logcnt = out = rebalance_experts(README_W, 16, 4, 2, 8, policy="hierarchical")
    np.testing.assert_array_equal(phy2log, README_PHY2LOG)
    np.testing.assert_array_equal(logcnt, [[1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1],
                                           [1, 2, 1, 1, 1, 2, 2, 1, 2, 1, 1, 1]])
    check_placement(README_W, 16, 4, 2, 8, "hierarchical", out)
    for a, b in zip(rebalance_experts(README_W, 16, 4, 2, 8), out):  # auto: 4 % 2 == 0
        np.testing.assert_array_equal(a, b)


# (L, E, G, N, P, R, policy)
SHAPES = [
    (3, 12, 4, 2, 8, 16, "hierarchical"),
    (3, 12, 4, 2, 8, 16, "global"),
    (2, 64, 8, 2, 8, 72, "hierarchical"),
    (2, 64, 8, 2, 8, 72, "global"),
    (2, 16, 4, 4, 4, 16, "hierarchical"),   # R == E: no spare slot
    (2, 16, 4, 4, 4, 16, "global"),
    (4, 32, 8, 4, 16, 64, "hierarchical"),  # two replicas per expert on average
    (2, 24, 6, 1, 6, 30, "hierarchical"),   # one node
    (2, 10, 5, 2, 4, 12, "auto"),           # 5 % 2 != 0: global
    (2, 10, 5, 2, 4, 12, "global"),
]


@pytest.mark.parametrize("L,E,G,N,P,R,policy", SHAPES)
@pytest.mark.parametrize("kind", ["ties", "float", "zeros"])
def test_invariants(L, E, G, N, P, R, policy, kind):
    rng = np.random.default_rng([L, E, G, N, P, R])
    if kind == "ties":
        w = rng.integers(0, 4, (L, E))          # many equal loads, some zero
    elif kind == "float":
        w = rng.pareto(1.0, (L, E)) * 100.0
    else:
        w = np.zeros((L, E))
    check_placement(w, R, G, N, P, policy, rebalance_experts(w, R, G, N, P, policy=policy))


def test_auto_and_global_policies():
    rng = np.random.default_rng(3)
    w = rng.integers(0, 100, (2, 10))
    auto = rebalance_experts(w, 12, 5, 2, 4)
    glob = rebalance_experts(w, 12, 5, 2, 4, policy="global")
    glob_other = rebalance_experts(w, 12, 1, 1, 4, policy="global")  # groups and nodes unused
    for a, b, c in zip(auto, glob, glob_other):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(b, c)


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_replicas=18), "num_replicas=18: must be a multiple of num_gpus=8"),
    (dict(num_gpus=6, num_replicas=18), "num_gpus=6: must be a multiple of num_nodes=4"),
    (dict(num_groups=5, num_nodes=1), "num_groups=5: must divide the number of experts 12"),
    (dict(num_replicas=8), "num_replicas=8: must be >= the number of experts 12"),
    (dict(weight=[[1.0] * 11 + [-2.0]]), "weight must be >= 0, got weight[0, 11]=-2.0"),
    (dict(weight=[[1.0] * 11 + [np.nan]]), "weight must be finite, got weight[0, 11]=nan"),
    (dict(weight=[[1.0] * 11 + [np.inf]]), "weight must be finite, got weight[0, 11]=inf"),
    (dict(weight=[1.0] * 12), "weight must be 2-D [rows, experts], got ndim=1"),
    (dict(weight=np.ones((1, 2, 12))), "weight must be 2-D [rows, experts], got ndim=3"),
    (dict(policy="greedy"), "policy='greedy': must be one of auto, hierarchical, global"),
    (dict(num_groups=6, num_nodes=4, policy="hierarchical"),
     "num_groups=6: the hierarchical policy needs a multiple of num_nodes=4"),
    (dict(num_gpus=0), "num_gpus=0: must be a positive int"),
    (dict(num_replicas=16.0), "num_replicas=16.0: must be a positive int"),
])
def test_errors_name_argument_and_value(kwargs, match):
    args = dict(weight=[[1.0] * 12], num_replicas=16, num_groups=4, num_nodes=4, num_gpus=8)
    args.update(kwargs)
    with pytest.raises(ValueError, match=re.escape(match)):
        rebalance_experts(**args)


def test_balanced_packing_hand_cases():
    # order 5(6), 0(5), 2(4), 4(3), 3(2), 1(1): p0 6, p1 5, p1 9, p0 9, p0 11 (tie: p0; now full), p1 10
    pack, rank = balanced_packing([[5, 1, 4, 2, 3, 6]], 2)
    np.testing.assert_array_equal(pack, [[1, 1, 1, 0, 0, 0]])
    np.testing.assert_array_equal(rank, [[0, 2, 1, 2, 1, 0]])
    # equal weights: stable order 0, 1, 2, 3 and the lowest pack on ties
    pack, rank = balanced_packing([[1, 1, 1, 1]], 2)
    np.testing.assert_array_equal(pack, [[0, 1, 0, 1]])
    np.testing.assert_array_equal(rank, [[0, 0, 1, 1]])
    # a full pack takes nothing more, however light: the last 1 goes to the 10
    pack, rank = balanced_packing([[10, 1, 1, 1], [1, 1, 1, 10]], 2)
    np.testing.assert_array_equal(pack, [[0, 1, 1, 0], [1, 1, 0, 0]])
    np.testing.assert_array_equal(rank, [[0, 0, 1, 1], [0, 1, 1, 0]])
    # one item per pack: items stay where they are
    pack, rank = balanced_packing([[3, 1, 2]], 3)
    np.testing.assert_array_equal(pack, [[0, 1, 2]])
    np.testing.assert_array_equal(rank, [[0, 0, 0]])
    with pytest.raises(ValueError, match=re.escape("num_packs=4: must divide the number of items 6")):
        balanced_packing([[1] * 6], 4)


def test_replicate_experts_hand_cases():
    # loads per replica 6,3,2 -> e0 (now 3,3,2) -> tie e0/e1: e0 (now 2,3,2) -> e1
    phy2log, rank, logcnt = replicate_experts([[6, 3, 2]], 6)
    np.testing.assert_array_equal(phy2log, [[0, 1, 2, 0, 0, 1]])
    np.testing.assert_array_equal(rank, [[0, 0, 0, 1, 2, 1]])
    np.testing.assert_array_equal(logcnt, [[3, 2, 1]])
    # rows are independent; num_phy == E is the identity
    phy2log, rank, logcnt = replicate_experts([[1, 4], [4, 1]], 3)
    np.testing.assert_array_equal(phy2log, [[0, 1, 1], [0, 1, 0]])
    np.testing.assert_array_equal(rank, [[0, 0, 1], [0, 0, 1]])
    np.testing.assert_array_equal(logcnt, [[1, 2], [2, 1]])
    phy2log, rank, logcnt = replicate_experts([[5, 7, 1]], 3)
    np.testing.assert_array_equal(phy2log, [[0, 1, 2]])
    assert (rank == 0).all() and (logcnt == 1).all()
    with pytest.raises(ValueError, match=re.escape("num_phy=2: must be >= the number of experts 3")):
        replicate_experts([[1, 2, 3]], 2)


def test_gpu_loads_hand_case():
    # expert 1 has 2 replicas (slots 1 and 3): each takes 4 / 2
    loads = gpu_loads([[3, 4, 5]], [[0, 1, 2, 1]], [[1, 2, 1]], 2)
    np.testing.assert_array_equal(loads, [[5.0, 7.0]])


def skewed_load():
    """Two layers of 64 experts at 10 tokens each, a few hot ones (as routing looks)."""
    w = np.full((2, 64), 10.0)
    w[0, [0, 1, 2, 3, 5, 8]] = [800, 600, 400, 300, 200, 100]   # all in group 0
    w[1, [40, 41, 42, 43, 44]] = [1000, 500, 500, 250, 250]     # groups 5
    return w


@pytest.mark.parametrize("policy,expected_max", [("hierarchical", [760.0, 810.0]),
                                                 ("global", [430.0, 436.0 + 2 / 3])])
def test_skewed_load_busiest_gpu(policy, expected_max):
    # 8 GPUs, one spare slot each (R = 72, 9 slots per GPU), 8 groups, 2 nodes.
    # Busiest GPU without EPLB (identity + spare slots to the 8 hottest): 1220 and 1290 tokens;
    # EPLB: hierarchical 760 and 810 (a hot group stays on one node), global 430 and 436.7;
    # the mean per GPU is 372.5 and 386.25.
    w = skewed_load()
    phy2log, _, logcnt = rebalance_experts(w, 72, 8, 2, 8, policy=policy)
    busiest = gpu_loads(w, phy2log, logcnt, 8).max(1)
    base_phy2log, base_logcnt = identity_placement(w, 72)
    base_busiest = gpu_loads(w, base_phy2log, base_logcnt, 8).max(1)
    np.testing.assert_allclose(base_busiest, [1220.0, 1290.0])
    np.testing.assert_allclose(busiest, expected_max)
    assert (busiest <= 0.65 * base_busiest).all()
    np.testing.assert_allclose(gpu_loads(w, phy2log, logcnt, 8).mean(1), [372.5, 386.25])


@pytest.mark.parametrize("E,G,N,P,R", [(64, 8, 2, 8, 72), (256, 8, 4, 32, 288), (32, 4, 2, 8, 40),
                                       (12, 4, 2, 8, 16)])
@pytest.mark.parametrize("policy", ["hierarchical", "global"])
def test_skewed_loads_never_worse_than_identity(E, G, N, P, R, policy):
    # background 5..14 tokens, 1 .. R - E hot experts at 200..999 at random places; over these
    # 20 seeds the worst ratio busiest(EPLB) / busiest(identity) was 0.78 hierarchical and 0.61
    # global at E=64, 0.49 / 0.31 at E=256
    for seed in range(20):
        rng = np.random.default_rng(seed)
        w = rng.integers(5, 15, (2, E)).astype(np.float64)
        for l in range(2):
            k = rng.integers(1, R - E + 1)
            w[l, rng.choice(E, k, replace=False)] = rng.integers(200, 1000, k)
        phy2log, _, logcnt = rebalance_experts(w, R, G, N, P, policy=policy)
        base_phy2log, base_logcnt = identity_placement(w, R)
        busiest = gpu_loads(w, phy2log, logcnt, P).max(1)
        base_busiest = gpu_loads(w, base_phy2log, base_logcnt, P).max(1)
        assert (busiest <= base_busiest).all(), (seed, busiest, base_busiest)


def test_hierarchical_can_lose_to_identity():
    # A limit of the greedy algorithm (DeepSeek's too), pinned so that it is known: one hot
    # expert (1000 tokens, the others 10), 16 experts, 4 groups, 2 nodes, 4 GPUs, 20 slots.
    # Its node gets 10 slots for 8 experts; replicate_experts gives both spares to it (3 replicas
    # of 333.3), and 3 replicas do not split over the node's 2 GPUs: busiest 696.7. The identity
    # placement gives it 2 replicas on different GPUs: busiest 540. Global EPLB: 5 replicas, 430.
    w = np.full((1, 16), 10.0)
    w[0, 10] = 1000.0
    base = gpu_loads(w, *identity_placement(w, 20), 4).max()
    hier = gpu_loads(w, *rebalance_experts(w, 20, 4, 2, 4, policy="hierarchical")[::2], 4).max()
    glob = gpu_loads(w, *rebalance_experts(w, 20, 4, 2, 4, policy="global")[::2], 4).max()
    assert base == pytest.approx(540.0)
    assert hier == pytest.approx(690.0 + 20 / 3)
    assert glob == pytest.approx(430.0)


def test_deterministic_and_input_untouched():
    rng = np.random.default_rng(11)
    w = rng.integers(0, 5, (3, 64))           # many ties
    w_copy = w.copy()
    for policy in ("hierarchical", "global"):
        first = rebalance_experts(w, 72, 8, 2, 8, policy=policy)
        for _ in range(2):
            for a, b in zip(first, rebalance_experts(w, 72, 8, 2, 8, policy=policy)):
                np.testing.assert_array_equal(a, b)
        # the same loads as floats or a nested list give the same placement
        for a, b in zip(first, rebalance_experts(w.astype(np.float32).tolist(), 72, 8, 2, 8, policy=policy)):
            np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(w, w_copy)
