"""The step-progress watchdog: a hang is a step that does not finish, not a silence.

The engine-core waits on its workers for each step's result. While it waits, the watchdog compares
how long the step has run with what it should take: the budget controller's prediction for that
step (the fitted step-time model, evenflow/core/sched/step_time_model.py) when the adaptive budget
runs, else the mean of recent steps per token. A step past ``SLOW_FACTOR`` times its prediction
(and at least ``SLOW_MIN_S``) is logged once, with its shape; a step past ``--step-timeout`` raises
StepTimeout, and the engine fails every request with that cause and exits non-zero.

Time is this process's running time (evenflow/protocol/liveness.py): a pause of the engine-core
itself is not the workers' slowness.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from evenflow.protocol import SchedulerOutput
from evenflow.protocol.liveness import RunningClock

log = logging.getLogger("evenflow.core.step_watchdog")

SLOW_FACTOR = 10.0
SLOW_MIN_S = 1.0
DEFAULT_STEP_TIMEOUT_S = 600.0  # a 4000-token unchunked prompt takes ~20 s on a small CPU model
_EWMA = 0.9  # weight of the history in the seconds-per-token estimate


class StepTimeout(RuntimeError):
    """A step ran past --step-timeout: the workers hang."""


@dataclass
class _Running:
    so: SchedulerOutput
    sent_at: float  # running clock


def step_shape_text(so: SchedulerOutput) -> str:
    """What a step holds, in words for a log line."""
    new = sum(len(r.prompt_token_ids) for r in so.scheduled_new_reqs)
    return (f"{so.total_num_scheduled_tokens} tokens of {len(so.num_scheduled_tokens)} requests "
            f"({len(so.scheduled_new_reqs)} new with {new} prompt tokens, "
            f"{sum(so.num_draft_slots.values())} draft tokens)")


class StepWatchdog:
    """Told when each step is sent and when its result came; ``check`` while waiting for one."""

    def __init__(self, step_timeout_s: float, predicted_s: Callable[[int], float | None] | None = None) -> None:
        self.step_timeout_s = step_timeout_s
        self._predicted_s = predicted_s  # step id -> the budget controller's prediction
        self._clock = RunningClock(max_step=1.0)  # observed every poll slice (100 ms) while waiting
        self._running: dict[int, _Running] = {}
        self._last_result_at = 0.0
        self._s_per_token: float | None = None
        self._warned: set[int] = set()

    def sent(self, so: SchedulerOutput) -> None:
        self._running[so.step_id] = _Running(so, self._clock.now())

    def done(self, step_id: int) -> None:
        item = self._running.pop(step_id, None)
        now = self._clock.now()
        if item is not None:
            seconds = now - max(item.sent_at, self._last_result_at)
            per_token = seconds / max(item.so.total_num_scheduled_tokens, 1)
            self._s_per_token = per_token if self._s_per_token is None else (
                _EWMA * self._s_per_token + (1 - _EWMA) * per_token)
        self._last_result_at = now
        self._warned.discard(step_id)

    def check(self, step_id: int) -> None:
        """Called while waiting for ``step_id``: log a step far past its prediction, raise past the limit."""
        item = self._running.get(step_id)
        if item is None:
            return
        now = self._clock.now()
        elapsed = now - max(item.sent_at, self._last_result_at)  # with overlap it starts when the last ended
        if elapsed > self.step_timeout_s:
            raise StepTimeout(f"step {step_id} has run {elapsed:.0f} s, past --step-timeout "
                              f"{self.step_timeout_s:g} s ({step_shape_text(item.so)}): the workers hang")
        predicted = self._prediction(item.so)
        if step_id not in self._warned and predicted is not None and elapsed > max(SLOW_FACTOR * predicted,
                                                                                    SLOW_MIN_S):
            self._warned.add(step_id)
            log.warning("step %d has run %.1f s, predicted %.3f s: %s (hard limit: --step-timeout %g s)",
                        step_id, elapsed, predicted, step_shape_text(item.so), self.step_timeout_s)

    def _prediction(self, so: SchedulerOutput) -> float | None:
        if self._predicted_s is not None and (predicted := self._predicted_s(so.step_id)) is not None:
            return predicted
        if self._s_per_token is None:
            return None
        return self._s_per_token * so.total_num_scheduled_tokens
