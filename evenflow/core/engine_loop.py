"""The step loop: schedule, send to the executor, receive, apply; the engine's one copy of it.

Overlap (``async_scheduling``): up to two steps are in flight. While the executor runs step N the
loop schedules step N+1 and sends it, then waits for N's results, applies them and schedules N+2.
The scheduler counts a placeholder for each token step N will sample; the worker fills those
tokens from its own last samples; requests that finished in N have their N+1 work discarded by
the scheduler. With overlap off a step is schedule -> send -> wait -> apply.

``EngineCore`` (engine.py) drives this loop for frontends over sockets; tests and benchmarks drive
it directly, with an ``InProcessExecutor`` or a fake one, so they run the loop production runs.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from evenflow.protocol import RequestOutput, SchedulerOutput, SchedulerStats
from evenflow.protocol.executor import Executor

from evenflow.core.sched.scheduler import Scheduler
from evenflow.core.step_timing import StepTiming


@dataclass
class LoopStep:
    """What one ``EngineLoop.step()`` did."""

    sent: bool  # a step was scheduled and sent
    outputs: list[RequestOutput] | None  # the applied step's outputs; None: no step was applied

    @property
    def progressed(self) -> bool:
        return self.sent or self.outputs is not None


@dataclass
class _InFlight:
    so: SchedulerOutput
    after_idle: bool  # the workers were idle because there was no work, not because of us


class EngineLoop:
    """A scheduler and an executor, up to ``depth`` steps in flight between them."""

    def __init__(self, scheduler: Scheduler, executor: Executor, async_scheduling: bool = True) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.depth = 2 if async_scheduling else 1
        self._in_flight: deque[_InFlight] = deque()
        self._pending_finished: list[str] = []  # finished ids of steps that were not sent
        self._pending_preempted: list[str] = []
        self._was_idle = True
        self._times = StepTiming()

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def has_work(self) -> bool:
        """Whether a step is in flight or a request is unfinished."""
        return bool(self._in_flight) or self.scheduler.has_unfinished_requests()

    def step(self) -> LoopStep:
        """Schedule and send a step, and/or apply the oldest one in flight (when the loop is full,
        or nothing new could be sent)."""
        sched = self.scheduler
        scheduled = False
        if len(self._in_flight) < self.depth and sched.has_unfinished_requests():
            so = sched.schedule()
            if so.total_num_scheduled_tokens > 0 or so.lora_prefetch or so.lora_unloaded:  # LoRA loads ride along
                self._send(so)
                scheduled = True
            else:  # nothing to run: carry the bookkeeping to the next step that is sent
                self._pending_finished.extend(so.finished_req_ids)
                self._pending_preempted.extend(so.preempted_req_ids)
        if self._in_flight and (len(self._in_flight) >= self.depth or not scheduled):
            return LoopStep(scheduled, self._apply_oldest())
        return LoopStep(scheduled, None)

    def send_finished(self) -> None:
        """When idle: tell the executor, in one empty step, of the requests finished since its
        last step, so that it holds no state. Production never needs this (the next real step
        carries them); tests and benchmarks that reuse one executor for several runs do."""
        assert not self.has_work(), "send_finished is for an idle loop"
        self._send(self.scheduler.schedule())
        self._apply_oldest()

    def _send(self, so: SchedulerOutput) -> None:
        if self._pending_finished:
            so.finished_req_ids = self._pending_finished + list(so.finished_req_ids)
            self._pending_finished = []
        if self._pending_preempted:
            so.preempted_req_ids = self._pending_preempted + list(so.preempted_req_ids)
            self._pending_preempted = []
        if so.finished_req_ids and so.preempted_req_ids:
            # A request preempted by a step the workers never got, then finished by the step in flight
            # before it (its last token), is only finished for them.
            finished = set(so.finished_req_ids)
            so.preempted_req_ids = [r for r in so.preempted_req_ids if r not in finished]
        self.executor.send_step(so)
        self._in_flight.append(_InFlight(so, after_idle=self._was_idle and not self._in_flight))
        self._was_idle = False

    def _apply_oldest(self) -> list[RequestOutput]:
        item = self._in_flight.popleft()
        mro = self.executor.recv_output(item.so.step_id)
        if item.after_idle:
            mro.wait_s = 0.0  # the clients' silence, not part of the step (see StepTiming)
        outputs = self.scheduler.update_from_output(item.so, mro)
        self._times.add_worker_step(mro, item.after_idle)
        if not self._in_flight and not self.scheduler.has_unfinished_requests():
            self._was_idle = True
        return outputs

    def stats(self) -> SchedulerStats:
        """The scheduler's stats with the executor-measured timing split filled in."""
        return self._times.fill(self.scheduler.get_stats())
