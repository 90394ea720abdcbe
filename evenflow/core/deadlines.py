"""Per-request deadlines: a heap of expiry times, checked once per engine loop iteration."""

from __future__ import annotations

import heapq
import itertools
import math

from evenflow.core.request import Request


def check_timeout(timeout_s: float) -> str | None:
    """A problem with a request's ``timeout_s`` (0 = the engine's default), or None."""
    if not (0.0 <= timeout_s < math.inf):
        return f"timeout_s must be finite and >= 0, got {timeout_s}"
    return None


class Deadlines:
    """Expiry times (monotonic seconds) of requests. Finished requests are not removed eagerly:
    the caller skips an expired entry whose Request object it no longer holds (so a reused id
    is never hit by its predecessor's deadline)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Request, float]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, request: Request, now: float, timeout_s: float) -> None:
        heapq.heappush(self._heap, (now + timeout_s, next(self._seq), request, timeout_s))

    def pop_expired(self, now: float) -> list[tuple[Request, float]]:
        """(request, its timeout) of every deadline at or before ``now``."""
        heap = self._heap
        expired = []
        while heap and heap[0][0] <= now:
            _, _, request, timeout_s = heapq.heappop(heap)
            expired.append((request, timeout_s))
        return expired
