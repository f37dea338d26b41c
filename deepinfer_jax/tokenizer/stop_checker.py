"""Stop-string detection on streamed output text.

``StopChecker.check(text_so_far, new_delta_len)`` is called after each text delta is appended.
Only matches that *end inside the new delta* are searched for (the text before it was checked on
earlier calls), so each call looks at the last ``new_delta_len + len(stop) - 1`` characters.

When several stop strings end in the delta, the earliest match wins: the one that completes
first (smallest end position), ties broken by the smallest start. This is the match a
character-by-character stream would have hit first, so the result does not depend on how the
text was split into deltas.

``max_holdback`` (longest stop length - 1) is how much trailing text the engine must not stream
yet: it could still turn out to be the start of a stop string that is excluded from the output.

This module must not import JAX.
"""

from __future__ import annotations

from typing import Iterable

__all__ = ["StopChecker"]


class StopChecker:
    """Find stop strings in output text.

    Args:
        stop: the stop strings (empty strings are ignored).
        include_stop_str_in_output: keep the matched stop string in the output text.
    """

    def __init__(self, stop: Iterable[str], include_stop_str_in_output: bool = False) -> None:
        self.stop: list[str] = [s for s in dict.fromkeys(stop) if s]
        self.include_stop_str_in_output = bool(include_stop_str_in_output)
        self.max_holdback: int = max((len(s) for s in self.stop), default=1) - 1

    def check(self, text_so_far: str, new_delta_len: int) -> tuple[bool, int | None]:
        """Look for a stop string ending in the last ``new_delta_len`` chars of ``text_so_far``.

        Returns:
            ``(True, truncate_to)`` on a match, where ``text_so_far[:truncate_to]`` is the output
            text (stop string excluded, or included with ``include_stop_str_in_output``);
            ``(False, None)`` otherwise.
        """
        if not self.stop or new_delta_len <= 0:
            return False, None
        n = len(text_so_far)
        delta_start = max(0, n - new_delta_len)
        best: tuple[int, int] | None = None  # (end, start)
        for s in self.stop:
            # A match ending in the delta starts at or after delta_start - len(s) + 1.
            idx = text_so_far.find(s, max(0, delta_start - len(s) + 1))
            if idx < 0:
                continue
            cand = (idx + len(s), idx)
            if best is None or cand < best:
                best = cand
        if best is None:
            return False, None
        end, start = best
        return True, end if self.include_stop_str_in_output else start
