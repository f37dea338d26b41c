"""``deferred_interrupts()``: hold SIGINT (Ctrl-C) across a short critical section and deliver it
right after, so a ``KeyboardInterrupt`` never lands half-way through a state update.

Used where an interrupt would lose or corrupt state: the jitted step consumes the donated cache
and the runner must store the new one (``runner/model_runner.py``); the engine's planning,
result processing and request bookkeeping (``engine/llm_engine.py``). Python delivers signals
to the main thread only, so elsewhere (and when SIGINT is not handled by Python code) this does
nothing. Nested sections hold the signal until the outermost one ends.

This module must not import JAX.
"""

from __future__ import annotations

import contextlib
import signal
import threading

_depth = 0  # nesting depth of held sections (main thread only)


@contextlib.contextmanager
def deferred_interrupts():
    global _depth
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if _depth:
        _depth += 1
        try:
            yield
        finally:
            _depth -= 1
        return
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):  # SIG_IGN / SIG_DFL / not set from Python: nothing to hold
        yield
        return
    pending: list = []
    signal.signal(signal.SIGINT, lambda signum, frame: pending.append((signum, frame)))
    _depth = 1
    try:
        yield
    finally:
        _depth = 0
        signal.signal(signal.SIGINT, previous)
        if pending:
            previous(*pending[0])  # the default handler raises KeyboardInterrupt here
