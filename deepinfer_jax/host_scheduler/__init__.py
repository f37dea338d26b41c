"""host scheduler: plain Python/NumPy, never imports JAX.

Host-side bookkeeping for the inference engine: which paged cache blocks
(:mod:`.block_pool`, with prefix caching) and which sliding-window slot
(:mod:`.slot_pool`) every running request uses.  Nothing in this package may
import ``jax``; it runs on the host, in the scheduler loop, and must stay cheap
to import and to test.
"""

from deepinfer_jax.host_scheduler.block_pool import (
    BlockPool,
    hash_block_tokens,
    hash_request_blocks,
)
from deepinfer_jax.host_scheduler.slot_pool import SlotPool

__all__ = ["BlockPool", "SlotPool", "hash_block_tokens", "hash_request_blocks"]
