"""Which cp device computes which token of a step: the balanced (mirror) layout, host side.

Balanced context parallelism (FEATURES §6) splits the ``T`` flat tokens of a dp rank's step
over its ``P`` cp devices, ``N = T // P`` token slots each:

* a row of ``n >= 2P`` tokens (a long prefill chunk) is cut into ``2P`` chunks of ``n / 2P``
  tokens (rounded); chunk ``k`` goes to device ``min(k, 2P-1-k)``, so every device holds one
  early and one late chunk and the causal work (keys per query grow with the position) is equal
  per device up to a chunk's rounding;
* shorter rows (decode tokens, short chunks) go token by token to the device holding the
  fewest tokens so far;
* a device that is full passes the rest of its tokens to the emptiest one. Any assignment gives
  the same outputs; only the balance depends on it.

``home_T[t]`` is where flat token ``t`` lives in the all-gather of the devices' slots
(``device * N + slot``), which rebuilds flat order on every device
(``sharding/context_parallel.py``). Padding tokens have no home (0): nothing reads them.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class CPLayout:
    index_PN: jax.Array   # int32 [P, N]: flat token of device p's slot n (0 for an empty slot)
    valid_PN: jax.Array   # bool  [P, N]: the slot holds a token of the step
    home_T: jax.Array     # int32 [T]: device * N + slot of flat token t (0 for padding)

    @property
    def num_devices(self) -> int:
        return self.index_PN.shape[0]


def mirror_chunks(n: int, P: int) -> np.ndarray:
    """Device of each of a long row's ``n`` tokens: ``2P`` chunks, chunk ``k`` on ``min(k, 2P-1-k)``."""
    k = (np.arange(n) * (2 * P)) // n
    return np.minimum(k, 2 * P - 1 - k)


def mirror_layout(lengths_R, num_tokens: int, P: int) -> CPLayout:
    """The layout of rows of ``lengths_R`` tokens packed from flat token 0 (``pack_batch``'s
    order) in a step of ``num_tokens`` tokens over ``P`` devices (module docstring)."""
    if P < 1 or num_tokens % P:
        raise ValueError(f"mirror_layout: num_tokens={num_tokens} must divide over cp={P} devices")
    n_R = np.asarray(lengths_R, np.int64)
    total = int(n_R.sum())
    if total > num_tokens:
        raise ValueError(f"mirror_layout: {total} tokens > num_tokens={num_tokens}")
    N = num_tokens // P
    dev_t = np.full(total, -1, np.int64)
    off = 0
    for n in n_R:
        if n >= 2 * P:
            dev_t[off:off + n] = mirror_chunks(int(n), P)
        off += int(n)
    count = np.bincount(dev_t[dev_t >= 0], minlength=P)
    for p in np.flatnonzero(count > N):        # over capacity: spill the device's last tokens
        mine = np.flatnonzero(dev_t == p)
        dev_t[mine[N:]] = -1
        count[p] = N
    for t in np.flatnonzero(dev_t < 0):        # short rows and spills: the emptiest device
        p = int(np.argmin(count))
        dev_t[t] = p
        count[p] += 1
    index = np.zeros((P, N), np.int32)
    valid = np.zeros((P, N), bool)
    home = np.zeros(num_tokens, np.int32)
    for p in range(P):
        toks = np.flatnonzero(dev_t == p)      # ascending: each device's tokens keep flat order
        index[p, :len(toks)] = toks
        valid[p, :len(toks)] = True
        home[toks] = p * N + np.arange(len(toks))
    return CPLayout(index, valid, home)
