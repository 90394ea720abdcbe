"""The CPU thread plan: short steps leave a core free, long ones use every core unless another
process keeps one busy, a fixed ``--worker-threads`` wins, and torch is only touched on change."""

from __future__ import annotations

import pytest
import torch
from evenflow.worker import threads
from evenflow.worker.threads import MIN_RETRY_GAP, StepThreads, ThreadSetter, plan_step_threads, step_flops

CPU = torch.device("cpu")
TINY, SMALL = 7_300_000, 107_000_000  # the demo presets' parameter counts


@pytest.mark.parametrize(("cores", "world", "small", "big"), [(2, 1, 1, 2), (16, 1, 15, 16), (16, 2, 7, 8),
                                                              (1, 1, 1, 1), (2, 2, 1, 1)])
def test_default_plan_from_cores(monkeypatch: pytest.MonkeyPatch, cores: int, world: int, small: int,
                                 big: int) -> None:
    monkeypatch.setattr(threads, "usable_cores", lambda: cores)
    assert plan_step_threads(CPU, world, None) == StepThreads(small, big)


def test_requested_count_is_fixed_and_gpu_keeps_torch_default() -> None:
    assert plan_step_threads(CPU, 1, 3) == StepThreads(3, 3)
    assert plan_step_threads(torch.device("cuda"), 1, None) is None


def test_long_steps_are_estimated_from_the_model_and_the_step() -> None:
    tiny = ThreadSetter(StepThreads(1, 2), TINY * 4)
    decodes = step_flops(TINY, 8, 8 * 300, 4, 4, 64)
    chunk = step_flops(TINY, 256 + 8, 256 * 1500 + 8 * 300, 4, 4, 64)
    assert not tiny.is_long(decodes) and tiny.is_long(chunk)
    # Streaming a 107M-parameter model's weights alone takes longer than the threshold.
    assert ThreadSetter(StepThreads(1, 2), SMALL * 4).is_long(step_flops(SMALL, 1, 100, 8, 16, 64))


class FakeTorch:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[int] = []
        monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
        monkeypatch.setattr(torch, "set_num_threads", self.calls.append)


def run_long_steps(setter: ThreadSetter, n: int, seconds_per_thread: dict[int, float],
                   tokens: int = 264) -> list[int]:
    used = []
    for _ in range(n):
        setter.before_step(1e10, tokens)
        used.append(setter.current)
        setter.after_step(seconds_per_thread[setter.current])
    return used


def test_uncontended_long_steps_always_use_every_core(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeTorch(monkeypatch)
    setter = ThreadSetter(StepThreads(1, 2), TINY * 4)
    assert run_long_steps(setter, 300, {1: 0.06, 2: 0.04}) == [2] * 300
    # Noise well within the contention factor (and steps of other sizes) changes nothing.
    assert run_long_steps(setter, 50, {1: 0.06, 2: 0.07}) == [2] * 50
    assert run_long_steps(setter, 50, {1: 0.06, 2: 0.2}, tokens=8) == [2] * 50
    setter.before_step(1e3, 8)  # a short step
    assert setter.current == 1
    assert fake.calls == [2, 1]


def test_contention_falls_back_to_fewer_threads_and_recovers(monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    FakeTorch(monkeypatch)
    setter = ThreadSetter(StepThreads(1, 2), TINY * 4)
    run_long_steps(setter, 20, {1: 0.06, 2: 0.04})
    # Another process now keeps a core busy: steps on every core stall 25x.
    contended = run_long_steps(setter, 400, {1: 0.07, 2: 1.0})
    assert contended.count(2) <= 7  # two stalls to confirm, then re-tries with a doubling gap
    assert contended[-50:] == [1] * 50
    assert "a core is busy elsewhere" in caplog.text  # operators see why steps slowed
    # The scheduler is told (ModelRunnerOutput.threads_fallback), short steps between included: it keeps
    # what long steps cost on fewer threads apart.
    assert setter.in_fallback
    setter.before_step(1e3, 8)  # a short step
    assert setter.in_fallback
    # The core is free again: the next re-try succeeds and every core is used from then on.
    free = run_long_steps(setter, 600, {1: 0.06, 2: 0.04})
    assert free[-300:] == [2] * 300
    assert setter.retry_gap == MIN_RETRY_GAP and not setter.in_fallback


def test_one_slow_step_is_a_hiccup_not_contention(monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    # One bad step (the host paused the VM, say) must not cost the next 16 long steps a thread.
    FakeTorch(monkeypatch)
    setter = ThreadSetter(StepThreads(1, 2), TINY * 4)
    used = run_long_steps(setter, 20, {1: 0.06, 2: 0.04})
    for _ in range(3):
        used += run_long_steps(setter, 1, {1: 0.06, 2: 1.0}) + run_long_steps(setter, 10, {1: 0.06, 2: 0.04})
    assert used == [2] * len(used) and "busy elsewhere" not in caplog.text
    # The hiccups did not become the baseline: two slow steps in a row still read as contention.
    assert run_long_steps(setter, 3, {1: 0.07, 2: 1.0}) == [2, 2, 1]


def test_setter_touches_torch_only_on_change(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeTorch(monkeypatch)
    setter = ThreadSetter(StepThreads(1, 1), TINY * 4)
    for flops in (1e3, 1e10, 1e3):
        setter.before_step(flops, 8)
        setter.after_step(0.01)
    assert fake.calls == []
    ThreadSetter(None, TINY * 4).before_step(1e12, 4096)
    assert fake.calls == []


class FakeRunQueue:
    """Run-queue wait the setter reads: ``per_second`` thread-seconds per second of each step."""

    def __init__(self) -> None:
        self.total = 0.0
        self.per_second = 0.0

    def read(self) -> float:
        return self.total

    def advance(self, seconds: float) -> None:
        self.total += self.per_second * seconds


def test_threads_waiting_for_a_cpu_mean_a_core_is_taken(monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    # The machine was busy from the start: long steps never cost more than the first ones did, so
    # only the run-queue wait shows that a core is taken.
    FakeTorch(monkeypatch)
    queue = FakeRunQueue()
    setter = ThreadSetter(StepThreads(1, 2), TINY * 4, queue.read)

    def steps(n: int, wait: float) -> list[int]:
        used = []
        queue.per_second = wait
        for _ in range(n):
            setter.before_step(1e10, 264)
            used.append(setter.current)
            queue.advance(0.05)
            setter.after_step(0.05)
        return used

    assert steps(200, 0.45) == [2] * 200  # the engine's own processes sharing the cores are not a taken core
    assert "busy elsewhere" not in caplog.text
    contended = steps(200, 0.8)
    assert contended[:2] == [2, 2] and contended.count(2) <= 6 and contended[-50:] == [1] * 50
    assert "waited for a CPU 0.80 s per second" in caplog.text
    assert steps(400, 0.0)[-300:] == [2] * 300  # the core is free again: every core from the next re-try on
    assert steps(30, 0.1) == [2] * 30  # a little waiting (the engine-core waking) is not contention


def test_a_shared_core_keeps_every_core_while_that_is_still_faster(monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    # Something shares the cores: the worker's threads wait for a CPU 0.7 s a second, yet a step on
    # every core still costs 0.05 s against 0.08 on fewer threads.
    FakeTorch(monkeypatch)
    queue = FakeRunQueue()
    queue.per_second = 0.7
    setter = ThreadSetter(StepThreads(1, 2), TINY * 4, queue.read)
    cost = {1: 0.08, 2: 0.05}

    def steps(n: int) -> list[int]:
        used = []
        for _ in range(n):
            setter.before_step(1e10, 264)
            used.append(setter.current)
            queue.advance(cost[setter.current])
            setter.after_step(cost[setter.current])
        return used

    used = steps(300)
    # Waiting alone reads as a taken core once; the fallback measures fewer threads, and from then on
    # every core is kept because it is faster.
    assert used[:2] == [2, 2] and used.count(1) == MIN_RETRY_GAP and used[-250:] == [2] * 250
    assert caplog.text.count("a core is busy elsewhere") == 1
    # A core really taken (every-core steps now cost more than fewer threads do) still falls back.
    cost[2] = 0.09
    assert steps(200)[-50:] == [1] * 50


def test_the_run_queue_wait_of_this_process_is_readable() -> None:
    from evenflow.worker.threads import process_run_queue_wait

    first = process_run_queue_wait()
    if first is None:
        pytest.skip("no /proc/self/task/*/schedstat here")
    second = process_run_queue_wait()
    assert second is not None and second >= first >= 0.0


def test_a_step_on_every_core_that_waited_for_one_is_marked_contended(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its time is the neighbour's: the budget controller learns nothing from it (budget_controller.py).
    The first such step too, before a second confirms the fallback; fallback steps and short ones are
    the machine's as it is, so they are not marked."""
    FakeTorch(monkeypatch)
    queue = FakeRunQueue()
    setter = ThreadSetter(StepThreads(1, 2), TINY * 4, queue.read)

    def step(flops: float, wait: float) -> tuple[int, bool]:
        queue.per_second = wait
        setter.before_step(flops, 264)
        queue.advance(0.05)
        setter.after_step(0.05)
        return setter.current, setter.contended

    assert [step(1e10, 0.3) for _ in range(20)] == [(2, False)] * 20
    assert [step(1e10, 0.8) for _ in range(3)] == [(2, True), (2, True), (1, False)]
    assert step(1e3, 0.8) == (1, False)  # a short step: not measured
