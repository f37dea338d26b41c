"""Sliding-window slot pool (host side, no JAX).

Besides its paged blocks, every running request owns exactly one
sliding-window SLOT: a row of the fixed-size device arrays that hold per-request
state which is not paged (window rings of the sliding-window attention and
the like).  ``SlotPool`` hands those rows out.

Rules
-----
* :meth:`SlotPool.allocate` gives the LOWEST free slot (keeps the live rows
  packed at the bottom, so a batch can be sliced to the highest live slot), or
  ``None`` when every slot is taken.
* A request holds at most one slot: allocating twice raises ``ValueError``;
  freeing or querying a request that holds no slot raises ``ValueError``.
* O(log n) per operation: the free slots are a binary heap.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable

__all__ = ["SlotPool"]


class SlotPool:
    """Fixed pool of ``num_slots`` sliding-window slots, ids ``0..num_slots-1``."""

    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.num_slots = int(num_slots)
        self._free: list[int] = list(range(self.num_slots))  # already a heap
        self._slot_of: dict[Hashable, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._slot_of)

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._slot_of

    def allocate(self, request_id: Hashable) -> int | None:
        """Give ``request_id`` the lowest free slot; ``None`` if none is free."""
        if request_id in self._slot_of:
            raise ValueError(f"request {request_id!r} already holds slot "
                             f"{self._slot_of[request_id]}")
        if not self._free:
            return None
        slot = heapq.heappop(self._free)
        self._slot_of[request_id] = slot
        return slot

    def free(self, request_id: Hashable) -> None:
        """Return the request's slot to the pool."""
        slot = self._slot_of.pop(request_id, None)
        if slot is None:
            raise ValueError(f"request {request_id!r} holds no slot")
        heapq.heappush(self._free, slot)

    def slot_of(self, request_id: Hashable) -> int:
        """The slot held by ``request_id`` (``ValueError`` if it holds none)."""
        slot = self._slot_of.get(request_id)
        if slot is None:
            raise ValueError(f"request {request_id!r} holds no slot")
        return slot

    def items(self) -> dict[Hashable, int]:
        """A copy of the ``request id -> slot`` map."""
        return dict(self._slot_of)
