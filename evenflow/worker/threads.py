"""How many torch (OpenMP) threads a CPU step runs on.

A CPU worker shares its cores with the engine-core, the frontends and their socket threads.

* A short step (a few decodes on a small model) is dominated by per-op overhead: a second thread
  gains nothing there and, when it lands on a core the engine-core is using, the OpenMP barrier
  waits for it. A long step (a prefill chunk, a big model's decode) nearly halves with every core.
  So by default a step whose single-thread time is estimated above ``LONG_STEP_SECONDS`` runs on
  every usable core, a shorter one leaves a core free. One run on 2 cores, tiny model,
  interference at budget 256 (docs/results/tuning_history.md, "Worker threads"): ITL p99 66.5 ms on 1 thread,
  42.0 on 2, 45.2 with this plan, which also had the highest throughput.
* All cores is a bet that they are free. When another process keeps a core busy, each of the
  step's parallel regions waits a scheduler time slice for the descheduled thread: in one run with
  a busy-looping process beside the tiny model, 2-thread steps made p99 ITL 1.27 s against 61 ms
  on 1 thread. Most of that was OpenMP's spinning (idle threads burning the slices the late one
  needed): workers spin only briefly before they sleep (``evenflow/worker/omp_env.py``). What is
  left, a region waiting for a thread that shares its core, ``ThreadSetter`` handles: it watches what long
  steps cost and leaves a core free for a while when one costs far more than usual.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger("evenflow.worker.threads")

# One core, as measured on a 2-core AVX2 EPYC: ~60 GFLOP/s of float32 GEMM, ~10 GB/s of weights
# streamed by a decode step. Only their ratio to LONG_STEP_SECONDS matters, so rough is fine.
CORE_FLOPS = 60e9
CORE_WEIGHT_BYTES_PER_S = 10e9
# A step estimated to take longer than this on one thread runs on every core.
LONG_STEP_SECONDS = 0.015
# A long step on every core that costs this much more per FLOP than the best seen for steps of
# its size means a core is taken: per-step estimates vary by well under 2x, contention costs 10x+.
CONTENTION_FACTOR = 2.5
# Consecutive such steps before falling back. One alone is more often a hiccup of the host (a
# shared VM) than a busy core, and 16 long steps on fewer threads cost more than the hiccup did.
CONTENTION_STREAK = 2
# The best-seen cost creeps up by this fraction per step, so a lasting change of the machine
# (other tenants, frequency) resets the baseline instead of reading as contention forever.
BASELINE_DRIFT = 0.01
# Long steps on fewer threads before every core is tried again: from MIN, doubling while contended.
MIN_RETRY_GAP, MAX_RETRY_GAP = 16, 1024
# A long step on every core whose threads stood in the run queue this many thread-seconds per
# second of the step had a core taken. One process busy beside N threads on N cores leaves N + 1
# runnable threads for N cores: each waits 1 / (N + 1) of a second, N / (N + 1) thread-seconds a
# second together, 2/3 at the least (0.80-0.82 measured beside a busy loop on 2 cores). The
# engine-core, the frontends and their clients on the same 2 cores make them wait 0.26-0.48 s a second
# in quiet served runs, while every core is still the faster plan (docs/results/steadiness.md, set 26).
RUN_QUEUE_WAIT_LIMIT = 0.6
# ... unless it still cost less than this share of what long steps of its size cost on fewer threads
# (measured during fallbacks): then the core is only shared, and every core is still the faster plan.
FEWER_THREADS_MARGIN = 0.9
# How fast the per-FLOP cost of long steps on fewer threads follows new ones (a moving average).
FEWER_THREADS_WEIGHT = 0.25


@dataclass(frozen=True)
class StepThreads:
    """Thread counts for short and long steps (equal when the user fixed the count)."""

    small: int
    big: int

    @property
    def counts(self) -> tuple[int, ...]:
        """Every count a step may run on."""
        return tuple(sorted({self.small, self.big}))


def process_run_queue_wait() -> float | None:
    """Seconds this process's threads have spent runnable but waiting for a CPU, summed over the
    threads (Linux ``/proc/self/task/*/schedstat``, its second field); None where not available."""
    total = 0
    try:
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/schedstat", "rb") as f:
                    total += int(f.read().split()[1])
            except (FileNotFoundError, ProcessLookupError):  # a thread that just exited
                continue
    except (OSError, IndexError, ValueError):
        return None
    return total / 1e9


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

    Long steps run on every core while that costs at most ``CONTENTION_FACTOR`` times the best
    per-FLOP cost seen for steps of the same size (log2 of the token count). When
    ``CONTENTION_STREAK`` in a row cost more, a core is busy elsewhere: long steps drop to the
    short-step count for ``retry_gap`` of them, then every core is tried again (the gap doubles
    while contention lasts). An uncontended machine never pays for a probe.

    A long step whose threads waited in the run queue more than ``RUN_QUEUE_WAIT_LIMIT`` (read with
    ``run_queue_wait``, e.g. ``process_run_queue_wait``) counts as such a step too: that sees a taken
    core directly, even when the best cost seen was itself measured on a busy machine. Once long
    steps of its size have run on fewer threads, such a step counts only when it did not beat their
    cost by ``FEWER_THREADS_MARGIN``: a core shared with the engine's own processes slows every
    core's steps a little, and fewer threads slow them more. Every such step is ``contended``: the
    engine-core's budget controller learns nothing from its time (the neighbour's, not the step's).

    ``weight_bytes``: what one step streams regardless of its size (this rank's weights).
    """

    def __init__(self, plan: StepThreads | None, weight_bytes: int,
                 run_queue_wait: Callable[[], float | None] | None = None) -> None:
        self.plan = plan
        self.run_queue_wait = run_queue_wait
        self._wait_before: float | None = None
        self.weight_seconds = weight_bytes / CORE_WEIGHT_BYTES_PER_S
        self.current = torch.get_num_threads()
        self.best: dict[int, float] = {}  # log2(tokens) -> best seconds per FLOP on every core
        self.fewer: dict[int, float] = {}  # log2(tokens) -> recent seconds per FLOP on fewer threads
        self.fallback_steps = 0  # long steps left on fewer threads
        self.retry_gap = MIN_RETRY_GAP
        self.slow_streak = 0  # consecutive long steps over the contention factor
        self._step: tuple[int, float] | None = None  # (size bucket, flops) of a long step
        self.contended = False  # the last step ran on every core while a core was busy elsewhere

    @property
    def in_fallback(self) -> bool:
        """Long steps run on fewer threads than the plan's for now: the next will, or the last one did (after the
        fallback's last step, until the retry on every core reports: a climb sized for that retry takes the
        fewer threads' price, the safe side)."""
        plan = self.plan
        return plan is not None and (self.fallback_steps > 0 or (self._step is not None and self.current != plan.big))

    def is_long(self, flops: float) -> bool:
        return self.weight_seconds + flops / CORE_FLOPS >= LONG_STEP_SECONDS

    def before_step(self, flops: float, num_tokens: int) -> None:
        """Set the thread count for a step of ``num_tokens`` tokens and ``flops`` (estimated)."""
        plan = self.plan
        self._step = None
        self.contended = False
        if plan is None:
            return
        wanted = plan.small
        if plan.big != plan.small and self.is_long(flops):
            if self.fallback_steps > 0:
                self.fallback_steps -= 1
            else:
                wanted = plan.big
                self._wait_before = self.run_queue_wait() if self.run_queue_wait is not None else None
            self._step = (num_tokens.bit_length(), flops)
        if wanted != self.current:
            torch.set_num_threads(wanted)
            self.current = wanted

    def _queue_wait_per_second(self, seconds: float) -> float | None:
        """Thread-seconds of run-queue wait per second of the step just measured (None: unknown)."""
        before, self._wait_before = self._wait_before, None
        if before is None or self.run_queue_wait is None or seconds <= 0:
            return None
        after = self.run_queue_wait()
        return None if after is None else (after - before) / seconds

    def after_step(self, seconds: float) -> None:
        """Record how long the step set up by the last ``before_step`` took."""
        if self._step is None:
            return
        bucket, flops = self._step
        cost = seconds / max(flops, 1.0)
        assert self.plan is not None  # a long step is recorded only under a plan
        if self.current != self.plan.big:  # a fallback step: what fewer threads cost
            fewer = self.fewer.get(bucket)
            self.fewer[bucket] = cost if fewer is None else fewer + FEWER_THREADS_WEIGHT * (cost - fewer)
            return
        best = self.best.get(bucket)
        waited = self._queue_wait_per_second(seconds)
        fewer = self.fewer.get(bucket)
        queued = (waited is not None and waited > RUN_QUEUE_WAIT_LIMIT
                  and (fewer is None or cost >= FEWER_THREADS_MARGIN * fewer))
        if queued or (best is not None and cost > CONTENTION_FACTOR * best):
            self.contended = True  # whether or not it is the streak's first
            self.slow_streak += 1
            # A retry after a fallback needs no confirmation: contention was already seen.
            if self.slow_streak < CONTENTION_STREAK and self.retry_gap == MIN_RETRY_GAP:
                return
            why = (f"its threads waited for a CPU {waited:.2f} s per second" if queued
                   else f"it took {cost / best:.1f}x its usual time per FLOP")  # type: ignore[operator]
            log.warning("a %d-thread step: %s, a core is busy elsewhere; the next %d long steps run on %d threads",
                        self.plan.big, why, self.retry_gap, self.plan.small)
            self.fallback_steps = self.retry_gap
            self.retry_gap = min(2 * self.retry_gap, MAX_RETRY_GAP)
            self.slow_streak = 0
            return
        self.slow_streak = 0
        if self.retry_gap != MIN_RETRY_GAP:
            log.info("long steps run on every core again")
        self.retry_gap = MIN_RETRY_GAP
        self.best[bucket] = cost if best is None else min(cost, best * (1 + BASELINE_DRIFT))


def step_flops(num_params: int, num_tokens: float, attention_pairs: float, layers: int, heads: int,
               head_dim: int) -> float:
    """Estimated FLOPs of a step: 2 per weight per token, plus QK^T and PV over every
    (query token, context token) pair in every layer and head."""
    return 2.0 * num_params * num_tokens + 4.0 * attention_pairs * layers * heads * head_dim
