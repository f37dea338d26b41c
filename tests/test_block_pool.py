"""Tests of the host scheduler's block pool (prefix caching) and slot pool.

Pure Python/NumPy; the package must never import JAX (checked in a subprocess).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer_jax.host_scheduler import (
    BlockPool,
    SlotPool,
    hash_block_tokens,
    hash_request_blocks,
)
from deepinfer_jax.host_scheduler.block_pool import ROOT_HASH

REPO_ROOT = Path(__file__).resolve().parent.parent
BT = 4  # block_tokens used by most tests


def snapshot(pool: BlockPool) -> tuple:
    """Everything observable about a pool's state."""
    return (
        pool.num_free,
        pool.free_block_ids(),
        [pool.ref_count(b) for b in range(pool.num_blocks)],
        [pool.block_hash(b) for b in range(pool.num_blocks)],
        pool.cached_items(),
        {r: pool.blocks_of(r) for r in list(pool._tables)},
        pool.evictions,
    )


def check_invariants(pool: BlockPool, tables: dict) -> None:
    """Independent invariant check against the test's own model of the tables."""
    free = pool.free_block_ids()
    free_set = set(free)
    assert len(free) == len(free_set) == pool.num_free
    counts = [0] * pool.num_blocks
    for r, table in tables.items():
        assert pool.blocks_of(r) == table
        for b in table:
            counts[b] += 1
    referenced = 0
    for b in range(pool.num_blocks):
        ref = pool.ref_count(b)
        assert ref == counts[b]
        if ref > 0:
            referenced += 1
            assert b not in free_set
        else:
            assert ref == 0 and b in free_set
    assert pool.num_free + referenced == pool.num_blocks
    cached = pool.cached_items()
    assert len(set(cached.values())) == len(cached)  # one block per hash
    for h, b in cached.items():
        assert pool.block_hash(b) == h
    for b in range(pool.num_blocks):
        h = pool.block_hash(b)
        if h is not None:
            assert cached[h] == b
    pool.check_invariants()


# --------------------------------------------------------------------- hashing
def test_hash_same_tokens_and_parent_equal():
    a = hash_block_tokens(None, [1, 2, 3, 4])
    assert a == hash_block_tokens(None, (1, 2, 3, 4))
    assert a == hash_block_tokens(ROOT_HASH, [1, 2, 3, 4])
    assert 0 <= a < 2**64
    b = hash_block_tokens(a, [5, 6, 7, 8], ("salt", 3))
    assert b == hash_block_tokens(a, [5, 6, 7, 8], ("salt", 3))


def test_hash_differs_on_parent_tokens_extra_keys():
    a = hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(a, [1, 2, 3, 4]) != a
    assert hash_block_tokens(None, [1, 2, 3, 5]) != a
    assert hash_block_tokens(None, [1, 2, 3, 4], ("x",)) != a
    assert hash_block_tokens(None, [1, 2, 3, 4], ("x",)) != hash_block_tokens(
        None, [1, 2, 3, 4], ("y",)
    )
    # type-tagged encoding: 1 != "1" != True
    keys = [(1,), ("1",), (True,), (1.0,), (b"1",), ((1,),)]
    hs = {hash_block_tokens(None, [0], k) for k in keys}
    assert len(hs) == len(keys)
    # token count is part of the hash
    assert hash_block_tokens(None, [0]) != hash_block_tokens(None, [0, 0])
    with pytest.raises(TypeError):
        hash_block_tokens(None, [1], (object(),))


def test_hash_request_blocks_only_full_blocks_and_chained():
    toks = list(range(100, 111))  # 11 tokens -> 2 full blocks of 4
    hs = hash_request_blocks(toks, BT)
    assert len(hs) == 2
    h0 = hash_block_tokens(None, toks[0:4])
    h1 = hash_block_tokens(h0, toks[4:8])
    assert hs == [h0, h1]
    # the partial tail does not matter
    assert hash_request_blocks(toks[:8], BT) == hs
    assert hash_request_blocks(toks[:7], BT) == hs[:1]
    assert hash_request_blocks(toks[:3], BT) == []
    # extra keys apply to every block
    hx = hash_request_blocks(toks, BT, ("lora", 7))
    assert hx[0] == hash_block_tokens(None, toks[0:4], ("lora", 7))
    assert hx[1] == hash_block_tokens(hx[0], toks[4:8], ("lora", 7))
    assert set(hx).isdisjoint(hs)
    # a change in block 0 changes every later hash (chaining)
    toks2 = [99] + toks[1:]
    hs2 = hash_request_blocks(toks2, BT)
    assert hs2[0] != hs[0] and hs2[1] != hs[1]


# ----------------------------------------------------------------- find_prefix
def _cached_request(pool: BlockPool, rid, toks) -> list[int]:
    hs = hash_request_blocks(toks, pool.block_tokens)
    table = pool.allocate(rid, [], pool.blocks_for_tokens(len(toks)))
    assert table is not None
    pool.cache_full_blocks(rid, hs)
    return table


def test_find_prefix_longest_run_and_first_miss():
    pool = BlockPool(16, BT)
    toks = list(range(1, 18))  # 17 tokens: 4 full blocks + 1
    table = _cached_request(pool, "a", toks)
    hs = hash_request_blocks(toks, BT)
    before = snapshot(pool)
    assert pool.find_prefix(hs, len(toks)) == table[:4]
    assert snapshot(pool) == before  # no state change
    # a miss in block 2 stops the run there even if later blocks "hit"
    other = toks[:8] + [0] + toks[9:]
    ho = hash_request_blocks(other, BT)
    assert ho[:2] == hs[:2] and ho[2] != hs[2]
    assert pool.find_prefix(ho, len(other)) == table[:2]
    # a run that hits block 3 but not 0 -> nothing
    assert pool.find_prefix([12345] + hs[1:], len(toks)) == []
    assert pool.find_prefix([], 10) == []


def test_find_prefix_never_covers_last_token():
    pool = BlockPool(16, BT)
    toks = list(range(1, 13))  # exactly 3 full blocks
    table = _cached_request(pool, "a", toks)
    hs = hash_request_blocks(toks, BT)
    assert len(hs) == 3
    assert pool.find_prefix(hs, 12) == table[:2]  # k full blocks -> k-1 hit
    assert pool.find_prefix(hs, 13) == table[:3]
    assert pool.find_prefix(hs[:1], 4) == []
    assert pool.find_prefix(hs[:1], 5) == table[:1]
    assert pool.find_prefix(hs, 1) == []
    assert pool.find_prefix(hs, 0) == []


def test_prefix_caching_disabled():
    pool = BlockPool(8, BT, enable_prefix_caching=False)
    toks = list(range(1, 14))
    hs = hash_request_blocks(toks, BT)
    assert pool.allocate("a", [], 4) == [0, 1, 2, 3]
    pool.cache_full_blocks("a", hs)  # no-op
    assert pool.num_cached == 0 and all(pool.block_hash(b) is None for b in range(8))
    assert pool.find_prefix(hs, len(toks), record=True) == []
    assert pool.hits == 0 and pool.queries == 13
    pool.free("a")
    assert pool.find_prefix(hs, len(toks)) == []


# ------------------------------------------------------------ refs / free / LRU
def test_shared_prefix_refcounts_free_order_and_lru_eviction():
    pool = BlockPool(10, BT)
    ta = list(range(1, 14))  # 13 tokens: 3 full + 1 partial
    tb = ta[:8] + [50, 51, 52, 53, 54]  # shares 2 full blocks with a
    ha, hb = hash_request_blocks(ta, BT), hash_request_blocks(tb, BT)
    assert ha[:2] == hb[:2] and ha[2] != hb[2]

    assert pool.allocate("a", [], 4) == [0, 1, 2, 3]
    pool.cache_full_blocks("a", ha)
    hits = pool.find_prefix(hb, len(tb))
    assert hits == [0, 1]
    assert pool.allocate("b", hits, 2) == [0, 1, 4, 5]
    pool.cache_full_blocks("b", hb)
    assert [pool.ref_count(b) for b in range(6)] == [2, 2, 1, 1, 1, 1]
    assert pool.num_free == 4 and pool.free_block_ids() == [6, 7, 8, 9]

    # freeing a: shared blocks keep b's reference and stay out of the free list
    pool.free("a")
    assert pool.ref_count(0) == pool.ref_count(1) == 1
    assert pool.free_block_ids() == [6, 7, 8, 9, 3, 2]  # a's table reversed
    assert pool.block_hash(2) == ha[2]  # freed blocks keep their hash
    # freeing b: its last block first, the shared prefix last
    pool.free("b")
    assert pool.free_block_ids() == [6, 7, 8, 9, 3, 2, 5, 4, 1, 0]
    assert pool.num_free == 10 and pool.usage == 0.0
    assert pool.evictions == 0
    assert pool.find_prefix(ha, len(ta)) == [0, 1, 2]
    assert pool.find_prefix(hb, len(tb)) == [0, 1, 4]

    # LRU: fresh blocks come from the head; 6..9 and 3 were never cached
    assert pool.allocate("c", [], 5) == [6, 7, 8, 9, 3]
    assert pool.evictions == 0
    assert pool.find_prefix(ha, len(ta)) == [0, 1, 2]
    # next pop reuses block 2 and evicts exactly a's third block
    assert pool.append("c", 1) == [2]
    assert pool.evictions == 1 and pool.cached_block(ha[2]) is None
    assert pool.block_hash(2) is None
    assert pool.find_prefix(ha, len(ta)) == [0, 1]
    assert pool.find_prefix(hb, len(tb)) == [0, 1, 4]
    # 5 was uncached (partial block); 4 holds b's third block
    assert pool.append("c", 2) == [5, 4]
    assert pool.evictions == 2
    assert pool.find_prefix(hb, len(tb)) == [0, 1]
    assert pool.free_block_ids() == [1, 0]
    check_invariants(pool, {"c": [6, 7, 8, 9, 3, 2, 5, 4]})


def test_hit_blocks_leave_free_list():
    pool = BlockPool(8, BT)
    toks = list(range(1, 14))
    hs = hash_request_blocks(toks, BT)
    _cached_request(pool, "a", toks)
    pool.free("a")
    assert pool.free_block_ids() == [4, 5, 6, 7, 3, 2, 1, 0]
    hits = pool.find_prefix(hs, len(toks))
    assert hits == [0, 1, 2]
    table = pool.allocate("a2", hits, 1)
    assert table == [0, 1, 2, 4]
    assert pool.free_block_ids() == [5, 6, 7, 3]
    assert pool.num_free == 4 and pool.evictions == 0
    check_invariants(pool, {"a2": table})


def test_cache_full_blocks_keeps_existing_block_for_duplicate_hash():
    pool = BlockPool(8, BT)
    toks = list(range(1, 10))
    hs = hash_request_blocks(toks, BT)
    assert pool.allocate("a", [], 3) == [0, 1, 2]
    assert pool.allocate("b", [], 3) == [3, 4, 5]  # same prompt, computed twice
    pool.cache_full_blocks("a", hs)
    pool.cache_full_blocks("b", hs)
    assert pool.cached_items() == {hs[0]: 0, hs[1]: 1}
    assert pool.block_hash(3) is None and pool.block_hash(4) is None
    pool.cache_full_blocks("a", hs[:1])  # idempotent
    assert pool.num_cached == 2
    with pytest.raises(ValueError):
        pool.cache_full_blocks("a", [hs[1], hs[0]])  # block 0 already has hs[0]
    with pytest.raises(ValueError):
        pool.cache_full_blocks("a", hs + [1, 2])  # more hashes than blocks
    check_invariants(pool, {"a": [0, 1, 2], "b": [3, 4, 5]})


# ---------------------------------------------------------------- all-or-nothing
def test_allocate_all_or_nothing_counts_hits_from_free_list():
    pool = BlockPool(6, BT)
    toks = list(range(1, 10))  # 2 full blocks + 1
    hs = hash_request_blocks(toks, BT)
    assert pool.allocate("a", [], 3) == [0, 1, 2]
    pool.cache_full_blocks("a", hs)
    assert pool.allocate("x", [], 2) == [3, 4]
    pool.free("a")
    assert pool.free_block_ids() == [5, 2, 1, 0]
    hits = pool.find_prefix(hs, len(toks))
    assert hits == [0, 1]

    before = snapshot(pool)
    # 3 <= num_free (4), but the 2 hits come out of the free list: only 2 remain
    assert not pool.can_allocate(hits, 3)
    assert pool.allocate("b", hits, 3) is None
    assert snapshot(pool) == before
    assert "b" not in pool
    assert pool.allocate("b", [], 5) is None
    assert snapshot(pool) == before
    # exact boundary succeeds
    assert pool.can_allocate(hits, 2)
    assert pool.allocate("b", hits, 2) == [0, 1, 5, 2]
    assert pool.evictions == 0  # block 2 was uncached (partial)
    assert pool.num_free == 0

    # a failing append changes nothing either
    before = snapshot(pool)
    assert pool.append("b", 1) is None
    assert snapshot(pool) == before
    pool.free("x")
    assert pool.free_block_ids() == [4, 3]
    before = snapshot(pool)
    assert pool.append("b", 3) is None
    assert snapshot(pool) == before
    assert pool.append("b", 2) == [4, 3]
    assert pool.append("b", 0) == []
    check_invariants(pool, {"b": [0, 1, 5, 2, 4, 3]})


def test_misuse_raises():
    pool = BlockPool(4, BT)
    assert pool.allocate("a", [], 1) == [0]
    with pytest.raises(ValueError):
        pool.allocate("a", [], 1)
    with pytest.raises(ValueError):
        pool.free("nope")
    with pytest.raises(ValueError):
        pool.append("nope", 1)
    with pytest.raises(ValueError):
        pool.allocate("b", [1], 0)  # block 1 is not cached
    with pytest.raises(ValueError):
        pool.allocate("b", [], -1)
    with pytest.raises(ValueError):
        BlockPool(0, 4)
    with pytest.raises(ValueError):
        BlockPool(4, 0)


def test_reset_prefix_cache():
    pool = BlockPool(8, BT)
    toks = list(range(1, 14))
    hs = hash_request_blocks(toks, BT)
    _cached_request(pool, "a", toks)
    assert pool.reset_prefix_cache() is False  # "a" still holds blocks
    assert pool.num_cached == 3
    pool.free("a")
    assert pool.reset_prefix_cache() is True
    assert pool.num_cached == 0
    assert pool.find_prefix(hs, len(toks)) == []
    assert pool.num_free == 8
    check_invariants(pool, {})


# ------------------------------------------------------------------ statistics
def test_hit_rate_statistic():
    pool = BlockPool(16, BT)
    assert pool.hit_rate == 0.0
    toks = list(range(1, 18))  # 17 tokens, 4 full blocks
    hs = hash_request_blocks(toks, BT)
    assert pool.find_prefix(hs, 17, record=True) == []
    assert (pool.queries, pool.hits) == (17, 0)
    _cached_request(pool, "a", toks)
    assert len(pool.find_prefix(hs, 17, record=True)) == 4
    assert (pool.queries, pool.hits) == (34, 16)
    pool.find_prefix(hs, 17)  # record=False: not counted
    pool.find_prefix(hs, 17, record=False)
    assert (pool.queries, pool.hits) == (34, 16)
    assert len(pool.find_prefix(hs, 16, record=True)) == 3
    assert (pool.queries, pool.hits) == (50, 28)
    assert pool.hit_rate == pytest.approx(28 / 50)
    pool.reset_stats()
    assert (pool.queries, pool.hits, pool.evictions, pool.hit_rate) == (0, 0, 0, 0.0)


def test_usage():
    pool = BlockPool(8, BT)
    assert pool.usage == 0.0
    pool.allocate("a", [], 2)
    assert pool.usage == pytest.approx(0.25) and pool.num_used == 2
    pool.allocate("b", [], 6)
    assert pool.usage == 1.0 and pool.num_free == 0


# ------------------------------------------------------------ randomized model
@pytest.mark.parametrize("seed", range(12))
def test_randomized_invariants(seed):
    rng = random.Random(seed)
    bt = rng.choice([1, 2, 4])
    pool = BlockPool(rng.randint(4, 40), bt, enable_prefix_caching=seed % 6 != 5)
    # shared-prefix workload: a few bases, random tails; small vocab => collisions
    bases = [[rng.randrange(5) for _ in range(rng.randint(0, 12))] for _ in range(4)]
    tables: dict[int, list[int]] = {}
    tokens: dict[int, list[int]] = {}
    content: dict[int, tuple] = {}  # shadow "device": block id -> its token ids
    next_id = 0

    def write(rid, first_block):
        """The device writes the request's blocks from index first_block on."""
        t = tokens[rid]
        for i in range(first_block, len(tables[rid])):
            content[tables[rid][i]] = tuple(t[i * bt : (i + 1) * bt])

    for _ in range(300):
        op = rng.random()
        if op < 0.35 or not tables:  # new request
            rid = next_id
            next_id += 1
            toks = rng.choice(bases) + [rng.randrange(5) for _ in range(rng.randint(1, 10))]
            hs = hash_request_blocks(toks, bt)
            hits = pool.find_prefix(hs, len(toks), record=True)
            assert len(hits) <= (len(toks) - 1) // bt
            for i, b in enumerate(hits):  # a hit really holds the same tokens
                assert content[b] == tuple(toks[i * bt : (i + 1) * bt])
            need = pool.blocks_for_tokens(len(toks)) - len(hits)
            expect_ok = need <= pool.num_free - sum(pool.ref_count(b) == 0 for b in hits)
            before = snapshot(pool)
            table = pool.allocate(rid, hits, need)
            if table is None:
                assert not expect_ok
                assert snapshot(pool) == before
            else:
                assert expect_ok and table[: len(hits)] == hits
                tables[rid], tokens[rid] = table, toks
                write(rid, len(hits))
                if rng.random() < 0.8:
                    pool.cache_full_blocks(rid, hs)
        elif op < 0.55:  # decode: append tokens, maybe new blocks
            rid = rng.choice(list(tables))
            toks = tokens[rid] + [rng.randrange(5) for _ in range(rng.randint(1, 2 * bt))]
            need = pool.blocks_for_tokens(len(toks)) - len(tables[rid])
            before = snapshot(pool)
            fresh = pool.append(rid, need)
            if fresh is None:
                assert need > pool.num_free and snapshot(pool) == before
            else:
                n_old = len(tables[rid])
                tables[rid] = tables[rid] + fresh
                tokens[rid] = toks
                write(rid, n_old - 1 if n_old else 0)  # last old block may grow
        elif op < 0.65:  # cache the full blocks of a running request
            rid = rng.choice(list(tables))
            hs = hash_request_blocks(tokens[rid], bt)
            pool.cache_full_blocks(rid, hs[: rng.randint(0, len(hs))])
        else:  # finish a request
            rid = rng.choice(list(tables))
            n_free_before = pool.num_free
            released = [b for b in reversed(tables[rid]) if pool.ref_count(b) == 1]
            pool.free(rid)
            del tables[rid], tokens[rid]
            # released blocks land at the tail, in reverse table order
            assert pool.free_block_ids()[n_free_before:] == released
        check_invariants(pool, tables)
        # cached blocks hold exactly the tokens their hash was computed from
        for h, b in pool.cached_items().items():
            assert b in content

    for rid in list(tables):
        pool.free(rid)
    check_invariants(pool, {})
    assert pool.num_free == pool.num_blocks
    assert 0.0 <= pool.hit_rate <= 1.0
    if not pool.enable_prefix_caching:
        assert pool.hits == 0 and pool.num_cached == 0


# ------------------------------------------------------------------- slot pool
def test_slot_pool():
    sp = SlotPool(3)
    assert sp.num_free == 3
    assert [sp.allocate(r) for r in "abc"] == [0, 1, 2]
    assert sp.allocate("d") is None and sp.num_free == 0
    with pytest.raises(ValueError):
        sp.allocate("a")
    sp.free("c")
    sp.free("a")
    assert sp.num_free == 2 and "a" not in sp
    assert sp.allocate("d") == 0  # lowest free slot
    assert sp.allocate("e") == 2
    assert sp.slot_of("b") == 1 and sp.slot_of("d") == 0
    assert sp.items() == {"b": 1, "d": 0, "e": 2}
    with pytest.raises(ValueError):
        sp.free("a")
    with pytest.raises(ValueError):
        sp.slot_of("a")
    with pytest.raises(ValueError):
        SlotPool(0)


# ------------------------------------------------------------------- no JAX
def test_host_scheduler_never_imports_jax():
    code = (
        "import sys\n"
        "import deepinfer_jax.host_scheduler as hs\n"
        "import deepinfer_jax.host_scheduler.block_pool\n"
        "import deepinfer_jax.host_scheduler.slot_pool\n"
        "bad = sorted(m for m in sys.modules if m == 'jax' or m.startswith(('jax.', 'jaxlib')))\n"
        "assert not bad, bad\n"
        "print(hs.hash_request_blocks(list(range(9)), 4, ('s', 1)))\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env,
        capture_output=True, text=True, timeout=60,
    )
    assert res.returncode == 0, res.stderr
    # hashes are deterministic across processes (sha256, not Python's hash())
    assert res.stdout.strip() == str(hash_request_blocks(list(range(9)), 4, ("s", 1)))
