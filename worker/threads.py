"""How many torch (OpenMP) threads a CPU step runs on.

A CPU worker shares its cores with the engine-core, the frontends and their socket threads. Small
steps (a few decodes) are bound by weight traffic and per-op overhead: a second thread gains
nothing there and, when it lands on a core the engine-core is using, the OpenMP barrier waits for
it. Large steps (a prefill chunk, many decodes) are compute-bound and nearly halve with every core.
So by default a step of at least ``BIG_STEP_TOKENS`` tokens runs on every usable core and a smaller
one leaves a core free (measured on 2 cores, tiny model, interference at budget 256: fixed 1
thread ITL p50 9.2 / p99 49 ms, fixed 2 threads 11.0 / 39 ms).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

# From about this many rows a matmul is compute-bound here (~60-90 GFLOP/s per core from M=64).
BIG_STEP_TOKENS = 64


@dataclass(frozen=True)
class StepThreads:
    """Thread counts for small and large steps (equal when the user fixed the count)."""

    small: int
    big: int

    def for_step(self, num_tokens: int) -> int:
        return self.big if num_tokens >= BIG_STEP_TOKENS else self.small


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def plan_step_threads(device: torch.device, world_size: int, requested: int | None) -> StepThreads | None:
    """The CPU thread plan for one rank, or None on a GPU (torch's own default stands there).

    ``requested`` (``--worker-threads``) fixes the count for every step.
    """
    if requested:
        return StepThreads(requested, requested)
    if device.type != "cpu":
        return None
    cores = usable_cores()
    return StepThreads(small=max(1, (cores - 1) // world_size), big=max(1, cores // world_size))


class ThreadSetter:
    """Applies a ``StepThreads`` plan before each step, touching torch only when the count changes."""

    def __init__(self, plan: StepThreads | None) -> None:
        self.plan = plan
        self.current = torch.get_num_threads()

    def before_step(self, num_tokens: int) -> None:
        if self.plan is None:
            return
        wanted = self.plan.for_step(num_tokens)
        if wanted != self.current:
            torch.set_num_threads(wanted)
            self.current = wanted
