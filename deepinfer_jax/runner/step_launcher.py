"""``StepLauncher``: the jitted calls of a runner's steps on one thread of their own.

A jitted call returns once the step is queued on the device, but the host works until then:
argument handling, and on a GPU the launch of every kernel of the step. On the engine's thread
that time adds to planning and result processing; with ``EngineConfig.dispatch_thread`` the
runner hands the call to this thread and returns (``ModelRunner._dispatch``), so the engine
plans the next step and processes the previous one's results meanwhile, wherever the call runs
without Python's GIL (jaxlib releases it around its runtime calls; its argument handling holds
it).

One thread, calls in submission order: each call reads the cache and the carried arrays the
previous call left on the runner, and only this thread touches them while calls are queued;
``drain()`` waits for the queue to empty before anything else reads or replaces them.

Both threads run Python between the GIL-free parts, and a thread that asks for the GIL gets it
only when the holder's switch interval runs out (Python's default: 5 ms), longer than a whole
step's host work. A launcher therefore lowers the process's switch interval to
``SWITCH_INTERVAL_S`` (never raises it; process-wide, as the GIL is).
"""

from __future__ import annotations

import concurrent.futures
import logging
import sys

SWITCH_INTERVAL_S = 2e-4

log = logging.getLogger(__name__)


class StepLauncher:
    def __init__(self):
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="deepinfer-step")
        self._last: concurrent.futures.Future | None = None
        if sys.getswitchinterval() > SWITCH_INTERVAL_S:
            log.info("dispatch thread: Python's switch interval %.4g s -> %.4g s", sys.getswitchinterval(),
                     SWITCH_INTERVAL_S)
            sys.setswitchinterval(SWITCH_INTERVAL_S)

    def submit(self, fn, *args) -> concurrent.futures.Future:
        """Queue ``fn(*args)`` after every call submitted before it."""
        self._last = self._pool.submit(fn, *args)
        return self._last

    def drain(self) -> None:
        """Wait until every submitted call has returned (a call's error stays with its future)."""
        last = self._last
        if last is not None:
            concurrent.futures.wait([last])
