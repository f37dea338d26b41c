"""EPLB: where each MoE expert's replicas go, so that no GPU of the expert-parallel group is busy
for much longer than the others.

DeepSeek's expert-parallel load balancer (github.com/deepseek-ai/EPLB), written again in NumPy.
Host-side and pure: it turns a load estimate per logical expert (e.g. token counts over a window
of steps) into a placement; nothing here imports JAX or touches the model.

Why: with expert parallelism every GPU holds the same number of expert slots, and a MoE layer
takes as long as its busiest GPU. Routing is skewed (a few hot experts get many tokens), so a
placement of one expert per slot leaves most GPUs waiting on the few that hold hot experts.
EPLB gives the spare ("redundant") slots to the hottest experts - a token routed to an expert
with c replicas goes to one of them, so each replica takes load/c - and then packs the replicas
onto GPUs so that every GPU gets a similar sum.

How (``rebalance_experts``), per layer:

1. *hierarchical* (DeepSeek's choice when the expert groups divide evenly over the nodes, to keep
   a group's traffic inside one node's fast interconnect): pack the G expert groups onto the N
   nodes with ``balanced_packing`` (each node gets G/N groups, heaviest group first into the
   lightest node with room); then, per node, give the node's R/N slots to its E/N experts with
   ``replicate_experts`` (one slot each, then repeatedly one more to the expert with the highest
   load per replica); then pack that node's replicas (each weighing load/count) onto its P/N GPUs
   with ``balanced_packing`` (R/P slots per GPU).
2. *global*: the same with one group and one node: replicate over all R slots, pack onto all P
   GPUs (DeepSeek calls the hierarchical routine with groups = nodes = 1).

Both steps are greedy (longest-processing-time first), not optimal, but fast and good on skewed
loads. They are not always better than the plain placement (expert e in slot e, the spare slots
to the hottest experts): replication does not look at the packing, so, e.g., one hot expert given
3 replicas on a node of 2 GPUs leaves one GPU with two of them (``tests/test_eplb.py`` pins such
a case), and on near-uniform loads the greedy result can be a few percent worse. Ties go the same way every time: ``balanced_packing`` visits items in a *stable*
descending sort of their weights (equal weights: lower index first) and picks the lowest pack
index among equally light packs with room; ``replicate_experts`` gives the replica to the lowest
expert index among equal load-per-replica values. With these rules the outputs match DeepSeek's
README example exactly (``tests/test_eplb.py``).

Outputs: ``phy2log_LR`` (the logical expert in each physical slot; slot r is on GPU r // (R/P)),
``log2phy_LEK`` (the slots holding each expert's replicas, replica rank k, -1 past its count) and
``logcnt_LE`` (replicas per expert). The engine routes onto them, keeps the window of per-step
loads and moves expert weights between steps in ``runner/dp_runner.py`` (``expert_replicas.py``).

Letters (local to this module; see ``deepinfer_jax/layers/README.md``): L MoE layers, E logical
(routed) experts, R physical expert slots (``num_replicas``), G expert groups, N nodes, P GPUs
(expert-parallel ranks), K most replicas of any one expert (``maxcnt``), X rows of independent
sub-problems (a layer, or a layer's node), I items to pack.
"""

from __future__ import annotations

import numpy as np

__all__ = ["rebalance_experts", "balanced_packing", "replicate_experts", "gpu_loads"]

POLICIES = ("auto", "hierarchical", "global")


def _check_weight(weight, name: str = "weight") -> np.ndarray:
    w = np.asarray(weight)
    if w.ndim != 2:
        raise ValueError(f"{name} must be 2-D [rows, experts], got ndim={w.ndim} (shape {w.shape})")
    if w.shape[0] < 1 or w.shape[1] < 1:
        raise ValueError(f"{name} must not be empty, got shape {w.shape}")
    if w.dtype == np.bool_ or not (np.issubdtype(w.dtype, np.integer) or np.issubdtype(w.dtype, np.floating)):
        raise ValueError(f"{name} must hold real numbers, got dtype {w.dtype}")
    w = w.astype(np.float64)
    if not np.all(np.isfinite(w)):
        r, c = np.argwhere(~np.isfinite(w))[0]
        raise ValueError(f"{name} must be finite, got {name}[{r}, {c}]={w[r, c]}")
    if np.any(w < 0):
        r, c = np.argwhere(w < 0)[0]
        raise ValueError(f"{name} must be >= 0, got {name}[{r}, {c}]={w[r, c]}")
    return w


def _check_count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}={value!r}: must be a positive int")
    return int(value)


def _inverse(perm_XI: np.ndarray) -> np.ndarray:
    """Row-wise inverse of permutations: ``inv[x, perm[x, i]] = i``."""
    inv = np.empty_like(perm_XI)
    np.put_along_axis(inv, perm_XI, np.broadcast_to(np.arange(perm_XI.shape[1]), perm_XI.shape), axis=1)
    return inv


def balanced_packing(weight, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack the I items of each row into ``num_packs`` packs of exactly I / num_packs items each,
    balancing the packs' weight sums.

    weight [X, I] -> (pack_index [X, I], rank_in_pack [X, I]), int64: the pack of each item and
    its position in that pack (the order it went in). Greedy: items in a stable descending sort
    of weight (equal weights: lower index first), each into the lightest pack that still has
    room (equally light: the lowest pack index). With one item per pack every assignment is
    equally balanced and items stay where they are (pack i gets item i), as in DeepSeek's code.
    """
    w_XI = _check_weight(weight)
    num_packs = _check_count("num_packs", num_packs)
    X, I = w_XI.shape
    if I % num_packs:
        raise ValueError(f"num_packs={num_packs}: must divide the number of items {I}")
    per_pack = I // num_packs
    if per_pack == 1:
        return np.broadcast_to(np.arange(I, dtype=np.int64), (X, I)).copy(), np.zeros((X, I), np.int64)
    order_XI = np.argsort(-w_XI, axis=1, kind="stable")
    pack_XI = np.full((X, I), -1, np.int64)
    rank_XI = np.full((X, I), -1, np.int64)
    for x in range(X):
        load = np.zeros(num_packs)
        count = np.zeros(num_packs, np.int64)
        for item in order_XI[x]:
            pack = int(np.argmin(np.where(count < per_pack, load, np.inf)))  # first minimum
            pack_XI[x, item] = pack
            rank_XI[x, item] = count[pack]
            load[pack] += w_XI[x, item]
            count[pack] += 1
    return pack_XI, rank_XI


def replicate_experts(weight, num_phy: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Spread ``num_phy`` physical slots over the E experts of each row, minimising the largest
    load per replica.

    weight [X, E] -> (phy2log [X, num_phy], rank [X, num_phy], logcnt [X, E]), int64. Slot e < E
    holds expert e (replica rank 0); each further slot goes to the argmax of weight / logcnt
    (ties: the lowest expert index), with rank = that expert's replica count before it.
    """
    w_XE = _check_weight(weight)
    num_phy = _check_count("num_phy", num_phy)
    X, E = w_XE.shape
    if num_phy < E:
        raise ValueError(f"num_phy={num_phy}: must be >= the number of experts {E}")
    phy2log_XR = np.empty((X, num_phy), np.int64)
    phy2log_XR[:, :E] = np.arange(E)
    rank_XR = np.zeros((X, num_phy), np.int64)
    logcnt_XE = np.ones((X, E), np.int64)
    rows = np.arange(X)
    for slot in range(E, num_phy):
        hot_X = np.argmax(w_XE / logcnt_XE, axis=1)  # first maximum
        phy2log_XR[:, slot] = hot_X
        rank_XR[:, slot] = logcnt_XE[rows, hot_X]
        logcnt_XE[rows, hot_X] += 1
    return phy2log_XR, rank_XR, logcnt_XE


def _rebalance_hierarchical(w_LE: np.ndarray, R: int, G: int, N: int, P: int):
    """(phy2log [L, R], phyrank [L, R], logcnt [L, E]); "mlog" numbers the experts node-major
    (node n's experts are mlog n*E/N .. (n+1)*E/N - 1), "pphy" is the final slot order."""
    L, E = w_LE.shape
    group_size = E // G
    groups_per_node = G // N
    E_node, R_node, P_node = E // N, R // N, P // N
    slots_per_gpu = R // P

    # 1. groups onto nodes
    group_load_LG = w_LE.reshape(L, G, group_size).sum(-1)
    gpack_LG, grank_LG = balanced_packing(group_load_LG, N)
    log2mlog_LE = (((gpack_LG * groups_per_node + grank_LG) * group_size)[:, :, None]
                   + np.arange(group_size)).reshape(L, E)
    mlog2log_LE = _inverse(log2mlog_LE)

    # 2. replicas within each node: rows are (layer, node)
    w_mlog_XE = np.take_along_axis(w_LE, mlog2log_LE, axis=1).reshape(L * N, E_node)
    phy2mlog_XR, phyrank_XR, mlogcnt_XE = replicate_experts(w_mlog_XE, R_node)

    # 3. each node's replicas onto its GPUs
    replica_load_XR = np.take_along_axis(w_mlog_XE / mlogcnt_XE, phy2mlog_XR, axis=1)
    pack_XR, rank_XR = balanced_packing(replica_load_XR, P_node)
    pphy2phy_XR = _inverse(pack_XR * slots_per_gpu + rank_XR)

    pphy2mlog_LR = (np.take_along_axis(phy2mlog_XR, pphy2phy_XR, axis=1).reshape(L, N, R_node)
                    + (np.arange(N) * E_node)[None, :, None]).reshape(L, R)
    phy2log_LR = np.take_along_axis(mlog2log_LE, pphy2mlog_LR, axis=1)
    phyrank_LR = np.take_along_axis(phyrank_XR, pphy2phy_XR, axis=1).reshape(L, R)
    logcnt_LE = np.take_along_axis(mlogcnt_XE.reshape(L, E), log2mlog_LE, axis=1)
    return phy2log_LR, phyrank_LR, logcnt_LE


def rebalance_experts(weight, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int,
                      policy: str = "auto") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Place R = ``num_replicas`` physical expert slots over ``num_gpus`` GPUs for each layer.

    weight [L, E] (load of each logical expert per layer, >= 0) -> (phy2log [L, R] int64,
    log2phy [L, E, K] int64 with -1 padding, logcnt [L, E] int64); K = logcnt.max(). Slot r is on
    GPU r // (R / num_gpus); log2phy[l, e, k] is the slot of replica k of expert e.

    ``policy``: "hierarchical" (groups onto nodes, replicas within a node, onto the node's GPUs;
    needs num_groups % num_nodes == 0), "global" (replicas over all slots, onto all GPUs; groups
    and nodes unused), "auto" (hierarchical if num_groups % num_nodes == 0, else global, as
    DeepSeek does). The arguments are checked whichever policy runs.
    """
    w_LE = _check_weight(weight)
    L, E = w_LE.shape
    R = _check_count("num_replicas", num_replicas)
    G = _check_count("num_groups", num_groups)
    N = _check_count("num_nodes", num_nodes)
    P = _check_count("num_gpus", num_gpus)
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r}: must be one of {', '.join(POLICIES)}")
    if P % N:
        raise ValueError(f"num_gpus={P}: must be a multiple of num_nodes={N}")
    if R % P:
        raise ValueError(f"num_replicas={R}: must be a multiple of num_gpus={P}")
    if E % G:
        raise ValueError(f"num_groups={G}: must divide the number of experts {E}")
    if R < E:
        raise ValueError(f"num_replicas={R}: must be >= the number of experts {E}")
    if policy == "auto":
        policy = "hierarchical" if G % N == 0 else "global"
    if policy == "hierarchical":
        if G % N:
            raise ValueError(f"num_groups={G}: the hierarchical policy needs a multiple of num_nodes={N}")
        phy2log_LR, phyrank_LR, logcnt_LE = _rebalance_hierarchical(w_LE, R, G, N, P)
    else:
        phy2log_LR, phyrank_LR, logcnt_LE = _rebalance_hierarchical(w_LE, R, 1, 1, P)

    K = int(logcnt_LE.max())
    log2phy_LEK = np.full((L, E * K), -1, np.int64)
    np.put_along_axis(log2phy_LEK, phy2log_LR * K + phyrank_LR,
                      np.broadcast_to(np.arange(R, dtype=np.int64), (L, R)), axis=1)
    return phy2log_LR, log2phy_LEK.reshape(L, E, K), logcnt_LE


def gpu_loads(weight, phy2log, logcnt, num_gpus: int) -> np.ndarray:
    """The load each GPU gets from a placement: [L, num_gpus], the sum over the GPU's slots
    (R / num_gpus consecutive ones) of weight[l, e] / logcnt[l, e] for the expert e in the slot."""
    w_LE = _check_weight(weight)
    phy2log_LR = np.asarray(phy2log, np.int64)
    logcnt_LE = np.asarray(logcnt, np.int64)
    P = _check_count("num_gpus", num_gpus)
    L, R = phy2log_LR.shape
    if R % P:
        raise ValueError(f"num_gpus={P}: must divide the number of slots {R}")
    per_slot_LR = np.take_along_axis(w_LE / logcnt_LE, phy2log_LR, axis=1)
    return per_slot_LR.reshape(L, P, R // P).sum(-1)
