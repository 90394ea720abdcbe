"""How many torch (OpenMP) threads a CPU step runs on.

A CPU worker shares its cores with the engine-core, the frontends and their socket threads.

* A short step (a few decodes on a small model) is dominated by per-op overhead: a second thread
  gains nothing there and, when it lands on a core the engine-core is using, the OpenMP barrier
  waits for it. A long step (a prefill chunk, a big model's decode) nearly halves with every core.
  So by default a step whose single-thread time is estimated above ``LONG_STEP_SECONDS`` runs on
  every usable core, a shorter one leaves a core free. Measured on 2 cores, tiny model,
  interference at budget 256: 1 thread ITL p50 9.2 / p99 49 ms, 2 threads 11.0 / 39 ms; this
  plan 7.9 / 37 ms.
* All cores is a bet that they are free. When another process keeps a core busy, each of the
  step's ~50 parallel regions waits a scheduler time slice for the descheduled thread: measured
  with one busy-looping process beside the tiny model, 2-thread steps made p99 ITL 1.27 s against
  61 ms on 1 thread. So ``ThreadSetter`` times long steps per unit of work with each thread count,
  uses the faster, and re-tries the other now and then (backing off while it keeps losing).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

# One core, as measured on a 2-core AVX2 EPYC: ~60 GFLOP/s of float32 GEMM, ~10 GB/s of weights
# streamed by a decode step. Only their ratio to LONG_STEP_SECONDS matters, so rough is fine.
CORE_FLOPS = 60e9
CORE_WEIGHT_BYTES_PER_S = 10e9
# A step estimated to take longer than this on one thread runs on every core.
LONG_STEP_SECONDS = 0.015
# Long steps between re-tries of the slower thread count: from MIN, doubling while it loses.
MIN_PROBE_GAP, MAX_PROBE_GAP = 16, 1024
COST_EMA = 0.25  # weight of the newest step in the running seconds-per-FLOP estimates
# Every core stays the choice unless it costs this much more per FLOP than one thread: the
# per-FLOP estimate of a step is noisy (~30%), contention is not subtle (10x and more).
CONTENTION_MARGIN = 1.5


@dataclass(frozen=True)
class StepThreads:
    """Thread counts for short and long steps (equal when the user fixed the count)."""

    small: int
    big: int


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def plan_step_threads(device: torch.device, world_size: int, requested: int | None) -> StepThreads | None:
    """The CPU thread plan for one rank, or None on a GPU (torch's own default stands there).
    ``requested`` (``--worker-threads``) fixes the count for every step."""
    if requested:
        return StepThreads(requested, requested)
    if device.type != "cpu":
        return None
    cores = usable_cores()
    return StepThreads(small=max(1, (cores - 1) // world_size), big=max(1, cores // world_size))


class ThreadSetter:
    """Picks each step's thread count (``before_step``) and learns from its time (``after_step``).

    ``weight_bytes``: what one step streams regardless of its size (this rank's weights).
    """

    def __init__(self, plan: StepThreads | None, weight_bytes: int) -> None:
        self.plan = plan
        self.weight_seconds = weight_bytes / CORE_WEIGHT_BYTES_PER_S
        self.current = torch.get_num_threads()
        self.cost: dict[int, float] = {}  # threads -> seconds per FLOP of long steps run with them
        self.until_probe = 0
        self.probe_gap = MIN_PROBE_GAP
        self._step: tuple[int, float, bool] | None = None  # (threads, flops, is_probe) of a long step

    def is_long(self, flops: float) -> bool:
        return self.weight_seconds + flops / CORE_FLOPS >= LONG_STEP_SECONDS

    def before_step(self, flops: float) -> None:
        """Set the thread count for a step of ``flops`` (estimated)."""
        plan = self.plan
        self._step = None
        if plan is None:
            return
        wanted = plan.small
        if plan.big != plan.small and self.is_long(flops):
            wanted, probe = self._choose_long()
            self._step = (wanted, flops, probe)
        if wanted != self.current:
            torch.set_num_threads(wanted)
            self.current = wanted

    def _choose_long(self) -> tuple[int, bool]:
        assert self.plan is not None
        big, small = self.plan.big, self.plan.small
        if big not in self.cost:
            return big, True
        if small not in self.cost:
            return small, True
        best = self._best()
        if self.until_probe <= 0:
            return (small if best == big else big), True
        self.until_probe -= 1
        return best, False

    def _best(self) -> int:
        assert self.plan is not None
        big, small = self.plan.big, self.plan.small
        return big if self.cost[big] <= CONTENTION_MARGIN * self.cost[small] else small

    def after_step(self, seconds: float) -> None:
        """Record how long the step chosen by the last ``before_step`` took."""
        if self._step is None or self.plan is None:
            return
        threads, flops, probe = self._step
        sample = seconds / max(flops, 1.0)
        if not probe:
            self.cost[threads] += COST_EMA * (sample - self.cost[threads])
            return
        # A probe's fresh measurement replaces the old one: the machine may have changed.
        self.cost[threads] = sample
        if len(self.cost) == 2:
            lost = self._best() != threads
            self.probe_gap = min(2 * self.probe_gap, MAX_PROBE_GAP) if lost else MIN_PROBE_GAP
            self.until_probe = self.probe_gap


def step_flops(num_params: int, num_tokens: int, attention_pairs: int, layers: int, heads: int,
               head_dim: int) -> float:
    """Estimated FLOPs of a step: 2 per weight per token, plus QK^T and PV over every
    (query token, context token) pair in every layer and head."""
    return 2.0 * num_params * num_tokens + 4.0 * attention_pairs * layers * heads * head_dim
