"""The time of one call of a function, for the probe scripts that compare kernels or variants."""

from __future__ import annotations

import time
from collections.abc import Callable


def per_call_ms(fn: Callable[[], object], calls: int, warmup: int = 3) -> float:
    """Milliseconds a call of ``fn`` takes, averaged over ``calls`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e3
