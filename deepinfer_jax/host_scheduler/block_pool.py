"""Paged-cache block pool with prefix caching (host side, no JAX).

The model keeps its paged per-request caches (compressed-KV and indexer-key
caches) in fixed-size blocks of ``block_tokens`` positions.  Block ``b`` holds
the entries of positions ``[i * block_tokens, (i + 1) * block_tokens)`` of the
request whose block table has ``b`` at index ``i``.  This module decides which
block ids every request uses; it never touches device memory.

Rules (the engine's documented semantics; tests check them exactly)
-------------------------------------------------------------------
* **Block hash.**  ``H(parent_hash, tuple(block token ids), extra_keys)``,
  chained from a fixed root (:data:`ROOT_HASH`): block ``i`` of a request has
  as parent the hash of block ``i - 1`` (the root for block 0), so a hash
  identifies the whole prefix up to and including its block.  ``H`` is SHA-256
  over a compact, type-tagged byte encoding, truncated to 64 bits (an unsigned
  ``int``); it is deterministic across processes and machines.  Only FULL
  blocks are hashed and only full blocks are ever cached.
* **Cache.**  A dict ``hash -> block id``; a cached block also stores its
  hash.  Each hash maps to exactly one block and each block carries at most
  one hash.
* **find_prefix(hashes, num_tokens)** returns the longest run of consecutive
  cache hits starting at the first block, never covering the last token: at
  most ``(num_tokens - 1) // block_tokens`` blocks, so at least the last prompt
  token is always recomputed (it produces the logits).  It changes no state
  (except the hit statistics when ``record=True``).
* **allocate(request, hits, num_new)** takes a reference on every hit block (a
  hit block sitting in the free list leaves it), then pops ``num_new`` fresh
  blocks from the HEAD of the free list, evicting their cached hash if they
  have one (a cached block is evicted only when it is reused).  All or
  nothing: if the free list cannot supply ``num_new`` blocks *after* the hits
  taken out of it, it returns ``None`` and nothing changes.
* **append(request, num_new)**: more fresh blocks for a running request, all
  or nothing.
* **cache_full_blocks(request, hashes)** registers the request's first
  ``len(hashes)`` blocks under those hashes; a hash already cached by another
  block keeps that block (no duplicates).
* **free(request)** drops one reference on each of the request's blocks;
  blocks reaching zero go to the TAIL of the free list in REVERSE table order
  (its last block first), keeping their cached hash.  The prefix blocks, the
  most reusable ones, are therefore evicted last.  The free list is thus an
  LRU: the head is the least recently freed block.
* With ``enable_prefix_caching=False`` :meth:`BlockPool.find_prefix` returns
  ``[]`` and :meth:`BlockPool.cache_full_blocks` is a no-op.

Every operation is O(1) per block touched: the free list is an
:class:`collections.OrderedDict` keyed by block id (pop from the head, append
at the tail, delete from the middle), the cache is a dict, reference counts
and per-block hashes are plain lists indexed by block id.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Hashable, Sequence

import numpy as np

__all__ = [
    "ROOT_HASH",
    "BlockPool",
    "hash_block_tokens",
    "hash_request_blocks",
]

_HASH_MASK = (1 << 64) - 1


def _digest64(data: bytes) -> int:
    """SHA-256 of ``data`` truncated to its first 8 bytes, as an unsigned int."""
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little")


#: Parent hash of block 0 of every request.
ROOT_HASH: int = _digest64(b"deepinfer_jax.host_scheduler.block_pool/root/v1")

_BLOCK_DOMAIN = b"deepinfer_jax.block/v1\x00"


def _encode_key(obj: object, out: bytearray) -> None:
    """Append a canonical, type-tagged, length-prefixed encoding of ``obj``.

    Supported: ``None``, ``bool``, ``int``, ``float``, ``str``, ``bytes`` and
    (nested) tuples/lists of these.  Anything else raises ``TypeError`` rather
    than silently relying on a non-deterministic ``repr`` or ``hash``.
    """
    if obj is None:
        out += b"N"
    elif isinstance(obj, bool):
        out += b"B\x01" if obj else b"B\x00"
    elif isinstance(obj, (int, np.integer)):
        v = int(obj)
        raw = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
        out += b"I" + struct.pack("<I", len(raw)) + raw
    elif isinstance(obj, (float, np.floating)):
        out += b"F" + struct.pack("<d", float(obj))
    elif isinstance(obj, str):
        raw = obj.encode("utf-8")
        out += b"S" + struct.pack("<Q", len(raw)) + raw
    elif isinstance(obj, (bytes, bytearray, memoryview)):
        raw = bytes(obj)
        out += b"Y" + struct.pack("<Q", len(raw)) + raw
    elif isinstance(obj, (tuple, list)):
        out += b"T" + struct.pack("<Q", len(obj))
        for item in obj:
            _encode_key(item, out)
    else:
        raise TypeError(f"unsupported extra-key type {type(obj).__name__!r}")


def _token_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"block tokens must be 1-D, got shape {arr.shape}")
    return arr.astype("<i8", copy=False).tobytes()


def _hash_block_bytes(parent: int, token_bytes: bytes, extra: bytes) -> int:
    buf = bytearray(_BLOCK_DOMAIN)
    buf += struct.pack("<QQ", parent, len(token_bytes) // 8)
    buf += token_bytes
    buf += extra
    return _digest64(bytes(buf))


def _encode_extra(extra_keys: tuple) -> bytes:
    out = bytearray()
    _encode_key(tuple(extra_keys), out)
    return bytes(out)


def hash_block_tokens(
    parent: int | None, tokens: Sequence[int], extra_keys: tuple = ()
) -> int:
    """Hash of one block: ``H(parent, tuple(tokens), extra_keys)``.

    ``parent`` is the hash of the previous block of the request, or ``None``
    for the first block (then :data:`ROOT_HASH` is used).  ``extra_keys`` is a
    tuple of ``None``/bool/int/float/str/bytes (nested tuples allowed) that
    must also match for two blocks to be shared (e.g. a cache salt, adapter id,
    multimodal input hashes).  Returns an unsigned 64-bit ``int``.
    """
    p = ROOT_HASH if parent is None else int(parent)
    if not 0 <= p <= _HASH_MASK:
        raise ValueError(f"parent hash {p} is not an unsigned 64-bit value")
    return _hash_block_bytes(p, _token_bytes(tokens), _encode_extra(extra_keys))


def hash_request_blocks(
    token_ids: Sequence[int] | np.ndarray, block_tokens: int, extra_keys: tuple = ()
) -> list[int]:
    """Chained hashes of the FULL blocks of ``token_ids``.

    Returns ``len(token_ids) // block_tokens`` hashes; element ``i`` equals
    ``hash_block_tokens(h[i-1], token_ids[i*bt:(i+1)*bt], extra_keys)`` with
    ``h[-1] = None`` (root).  A trailing partial block is not hashed.
    """
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    arr = np.asarray(token_ids, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {arr.shape}")
    extra = _encode_extra(extra_keys)
    n_full = arr.shape[0] // block_tokens
    raw = arr[: n_full * block_tokens].astype("<i8", copy=False).tobytes()
    step = block_tokens * 8
    hashes: list[int] = []
    parent = ROOT_HASH
    for i in range(n_full):
        parent = _hash_block_bytes(parent, raw[i * step : (i + 1) * step], extra)
        hashes.append(parent)
    return hashes


class BlockPool:
    """Paged-cache block allocator with reference counts and prefix caching.

    See the module docstring for the exact rules.  Request ids are any
    hashable values.  Methods raise ``ValueError`` on misuse (unknown request,
    duplicate request, bad block ids); running out of blocks is not an error:
    :meth:`allocate` and :meth:`append` then return ``None`` and leave the pool
    untouched.

    Statistics: :attr:`queries` and :attr:`hits` count prompt TOKENS looked up
    and found by :meth:`find_prefix` calls made with ``record=True``;
    :attr:`hit_rate` is their ratio; :attr:`evictions` counts cached hashes
    dropped because their block was reused.
    """

    def __init__(
        self, num_blocks: int, block_tokens: int, enable_prefix_caching: bool = True
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_tokens <= 0:
            raise ValueError(f"block_tokens must be positive, got {block_tokens}")
        self.num_blocks = int(num_blocks)
        self.block_tokens = int(block_tokens)
        self.enable_prefix_caching = bool(enable_prefix_caching)
        # Free list, head = least recently freed (next to be reused).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(self.num_blocks))
        self._ref: list[int] = [0] * self.num_blocks
        self._block_hash: list[int | None] = [None] * self.num_blocks
        self._cached: dict[int, int] = {}  # hash -> block id
        self._tables: dict[Hashable, list[int]] = {}  # request id -> block table
        self.queries = 0
        self.hits = 0
        self.evictions = 0

    # ------------------------------------------------------------------ stats
    @property
    def num_free(self) -> int:
        """Blocks in the free list (ref count 0; possibly still cached)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks referenced by at least one request."""
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by running requests, in [0, 1]."""
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def hit_rate(self) -> float:
        """``hits / queries`` in tokens over recorded lookups (0.0 if none)."""
        return self.hits / self.queries if self.queries else 0.0

    @property
    def num_cached(self) -> int:
        """Number of cached hashes (referenced or free blocks)."""
        return len(self._cached)

    @property
    def num_requests(self) -> int:
        return len(self._tables)

    def reset_stats(self) -> None:
        """Zero the query/hit/eviction counters."""
        self.queries = self.hits = self.evictions = 0

    # ---------------------------------------------------------- introspection
    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._tables

    def blocks_of(self, request_id: Hashable) -> list[int]:
        """A copy of the request's block table."""
        return list(self._table(request_id))

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def block_hash(self, block_id: int) -> int | None:
        """The cached hash stored on ``block_id`` (``None`` if not cached)."""
        return self._block_hash[block_id]

    def cached_block(self, block_hash: int) -> int | None:
        """The block caching ``block_hash``, or ``None``."""
        return self._cached.get(block_hash)

    def cached_items(self) -> dict[int, int]:
        """A copy of the ``hash -> block id`` cache map."""
        return dict(self._cached)

    def free_block_ids(self) -> list[int]:
        """The free list, head (next reused) first."""
        return list(self._free)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` positions (ceil division)."""
        return -(-int(num_tokens) // self.block_tokens)

    # ----------------------------------------------------------------- lookup
    def record_lookup(self, num_tokens: int, num_hit_blocks: int) -> None:
        """Count one lookup in the hit statistics (the scheduler calls this once per admission)."""
        self.queries += max(int(num_tokens), 0)
        self.hits += int(num_hit_blocks) * self.block_tokens

    def find_prefix(
        self, block_hashes: Sequence[int], num_tokens: int, record: bool = False
    ) -> list[int]:
        """Block ids of the longest cached prefix of a request.

        ``block_hashes`` are the request's full-block hashes (from
        :func:`hash_request_blocks`), ``num_tokens`` its prompt length.  The
        result covers at most ``(num_tokens - 1) // block_tokens`` blocks and
        stops at the first miss.  No state changes; with ``record=True`` the
        lookup adds ``num_tokens`` to :attr:`queries` and the hit tokens to
        :attr:`hits`.
        """
        hit_blocks: list[int] = []
        if self.enable_prefix_caching and num_tokens > 0:
            max_blocks = (int(num_tokens) - 1) // self.block_tokens
            cached = self._cached
            for h in block_hashes[:max_blocks]:
                b = cached.get(h)
                if b is None:
                    break
                hit_blocks.append(b)
        if record:
            self.record_lookup(num_tokens, len(hit_blocks))
        return hit_blocks

    # ------------------------------------------------------------- allocation
    def can_allocate(self, hit_blocks: Sequence[int], num_new: int) -> bool:
        """Whether :meth:`allocate` with these arguments would succeed."""
        from_free = sum(1 for b in hit_blocks if self._ref[b] == 0)
        return num_new <= len(self._free) - from_free

    def allocate(
        self, request_id: Hashable, hit_blocks: Sequence[int], num_new: int
    ) -> list[int] | None:
        """Create the block table of a new request: ``hit_blocks + fresh``.

        ``hit_blocks`` must be cached blocks (normally the result of
        :meth:`find_prefix` just before).  Each gains a reference (leaving the
        free list if it was there); then ``num_new`` blocks are popped from the
        head of the free list, their cached hashes evicted.  Returns a copy of
        the new table, or ``None`` with no state change if the free list holds
        fewer than ``num_new`` blocks once the hits are taken out of it.
        """
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already holds blocks")
        if num_new < 0:
            raise ValueError(f"num_new must be >= 0, got {num_new}")
        hits = [int(b) for b in hit_blocks]
        if len(set(hits)) != len(hits):
            raise ValueError(f"duplicate hit blocks {hits}")
        for b in hits:
            if not 0 <= b < self.num_blocks:
                raise ValueError(f"block id {b} out of range [0, {self.num_blocks})")
            if self._block_hash[b] is None:
                raise ValueError(f"hit block {b} is not a cached block")
        if not self.can_allocate(hits, num_new):
            return None
        for b in hits:
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1
        table = hits + self._pop_free(num_new)
        self._tables[request_id] = table
        return list(table)

    def append(self, request_id: Hashable, num_new: int) -> list[int] | None:
        """Append ``num_new`` fresh blocks to a running request's table.

        Returns the new block ids, or ``None`` with no state change if fewer
        than ``num_new`` blocks are free.
        """
        table = self._table(request_id)
        if num_new < 0:
            raise ValueError(f"num_new must be >= 0, got {num_new}")
        if num_new > len(self._free):
            return None
        fresh = self._pop_free(num_new)
        table.extend(fresh)
        return fresh

    def _pop_free(self, n: int) -> list[int]:
        """Pop ``n`` blocks from the free-list head, evict hashes, ref := 1."""
        out: list[int] = []
        free, ref, block_hash, cached = self._free, self._ref, self._block_hash, self._cached
        for _ in range(n):
            b, _ = free.popitem(last=False)
            h = block_hash[b]
            if h is not None:
                del cached[h]
                block_hash[b] = None
                self.evictions += 1
            ref[b] = 1
            out.append(b)
        return out

    # ---------------------------------------------------------------- caching
    def cache_full_blocks(self, request_id: Hashable, block_hashes: Sequence[int]) -> None:
        """Register the request's first ``len(block_hashes)`` blocks as cached.

        Blocks already carrying their hash are skipped; a hash already cached
        by another block keeps that block (this block stays uncached).  Call
        it once the device has written those blocks completely.
        """
        table = self._table(request_id)
        if not self.enable_prefix_caching:
            return
        if len(block_hashes) > len(table):
            raise ValueError(
                f"{len(block_hashes)} hashes for a table of {len(table)} blocks"
            )
        block_hash, cached = self._block_hash, self._cached
        for b, h in zip(table, block_hashes):
            h = int(h)
            cur = block_hash[b]
            if cur is not None:
                if cur != h:
                    raise ValueError(
                        f"block {b} is cached as {cur:#x}, cannot re-cache as {h:#x}"
                    )
                continue
            if h in cached:
                continue
            cached[h] = b
            block_hash[b] = h

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash (e.g. after a weight update).

        Only legal while no block is referenced: returns ``False`` and changes
        nothing if some request still holds blocks, ``True`` otherwise.
        """
        if self._tables:
            return False
        self._cached.clear()
        self._block_hash = [None] * self.num_blocks
        return True

    # ------------------------------------------------------------------- free
    def free(self, request_id: Hashable) -> None:
        """Release a request's blocks (see module docstring for the order)."""
        table = self._tables.pop(request_id, None)
        if table is None:
            raise ValueError(f"unknown request {request_id!r}")
        ref, free = self._ref, self._free
        for b in reversed(table):
            ref[b] -= 1
            if ref[b] == 0:
                free[b] = None

    def _table(self, request_id: Hashable) -> list[int]:
        table = self._tables.get(request_id)
        if table is None:
            raise ValueError(f"unknown request {request_id!r}")
        return table

    # ------------------------------------------------------------- debugging
    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the internal state is inconsistent."""
        counts = [0] * self.num_blocks
        for table in self._tables.values():
            assert len(set(table)) == len(table), f"duplicate blocks in {table}"
            for b in table:
                counts[b] += 1
        assert counts == self._ref, "ref counts differ from block tables"
        for b in range(self.num_blocks):
            assert (self._ref[b] == 0) == (b in self._free), f"block {b} free/ref mismatch"
        assert len(self._free) + sum(1 for r in self._ref if r > 0) == self.num_blocks
        for h, b in self._cached.items():
            assert self._block_hash[b] == h, f"block {b} hash mismatch"
        n_hashed = sum(1 for h in self._block_hash if h is not None)
        assert n_hashed == len(self._cached), "blocks carry hashes missing from the cache"
