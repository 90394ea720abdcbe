"""The engine's step loop: steps in flight, empty steps held back, finished ids delivered."""

from __future__ import annotations

from evenflow.core.engine_loop import EngineLoop
from evenflow.core.request import Request
from evenflow.core.sched.config import SchedulerConfig
from evenflow.core.sched.scheduler import Scheduler
from evenflow.protocol import ModelRunnerOutput, SamplingParams, SchedulerOutput

from .driver import FakeExecutor
from .fake_model import EOS_TOKEN_ID


class LoggingExecutor(FakeExecutor):
    """The fake executor, logging each call: ("send", step_id) and ("recv", step_id)."""

    def __init__(self, scheduler: Scheduler) -> None:
        super().__init__(scheduler, None)
        self.calls: list[tuple[str, int]] = []

    def send_step(self, so: SchedulerOutput) -> None:
        self.calls.append(("send", so.step_id))
        super().send_step(so)

    def recv_output(self, step_id: int) -> ModelRunnerOutput:
        self.calls.append(("recv", step_id))
        return super().recv_output(step_id)


def loop_with(async_scheduling: bool, *requests: tuple[str, int]) -> tuple[EngineLoop, LoggingExecutor]:
    """A loop over a fresh scheduler holding ``(request_id, max_tokens)`` requests of 4-token prompts."""
    scheduler = Scheduler(SchedulerConfig(num_kv_blocks=16, max_num_batched_tokens=64, max_model_len=64, block_size=4))
    for request_id, max_tokens in requests:
        scheduler.add_request(Request(request_id, [3, 4, 5, 6], SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                      eos_token_ids=(EOS_TOKEN_ID,)))
    executor = LoggingExecutor(scheduler)
    return EngineLoop(scheduler, executor, async_scheduling=async_scheduling), executor


def run_to_end(loop: EngineLoop) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while loop.has_work():
        for out in loop.step().outputs or ():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def test_with_async_scheduling_the_next_step_is_sent_before_the_previous_one_is_applied() -> None:
    loop, executor = loop_with(True, ("a", 3))
    tokens = run_to_end(loop)
    assert len(tokens["a"]) == 3
    # A fourth step, scheduled while the third token is in flight, would run past max_tokens: it
    # is empty, not sent, and the third step is received without one behind it.
    assert executor.calls == [("send", 0), ("send", 1), ("recv", 0), ("send", 2), ("recv", 1), ("recv", 2)]


def test_without_async_scheduling_each_step_is_applied_before_the_next_is_scheduled() -> None:
    loop, executor = loop_with(False, ("a", 3))
    assert len(run_to_end(loop)["a"]) == 3
    assert executor.calls == [("send", 0), ("recv", 0), ("send", 1), ("recv", 1), ("send", 2), ("recv", 2)]


def test_an_empty_step_is_not_sent_and_its_finished_ids_go_with_the_next_one_sent() -> None:
    loop, executor = loop_with(True, ("y", 100), ("x", 1))
    assert loop.step().sent  # both prefill; x's one token is now in flight
    loop.scheduler.abort_requests(["y"])
    step = loop.step()  # x owes nothing more: the step is empty, only the first one is applied
    assert not step.sent and step.outputs is not None and [o.request_id for o in step.outputs] == ["x"]
    assert not loop.has_work()
    assert [so.step_id for so in executor.steps] == [0]
    loop.send_finished()  # an idle loop tells the executor of y (aborted) and x (done) at once
    assert executor.steps[-1].total_num_scheduled_tokens == 0
    assert executor.steps[-1].finished_req_ids == ["y", "x"]
    assert executor.worker.tokens == {}
