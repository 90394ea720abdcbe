"""The CPU thread plan: small steps leave a core free, large steps use them all, a fixed
``--worker-threads`` wins, and torch is only touched when the count changes."""

from __future__ import annotations

import pytest
import torch
from evenflow.worker import threads
from evenflow.worker.threads import BIG_STEP_TOKENS, StepThreads, ThreadSetter, plan_step_threads

CPU = torch.device("cpu")


@pytest.mark.parametrize(("cores", "world", "small", "big"), [(2, 1, 1, 2), (16, 1, 15, 16), (16, 2, 7, 8),
                                                              (1, 1, 1, 1), (2, 2, 1, 1)])
def test_default_plan_from_cores(monkeypatch: pytest.MonkeyPatch, cores: int, world: int, small: int,
                                 big: int) -> None:
    monkeypatch.setattr(threads, "usable_cores", lambda: cores)
    assert plan_step_threads(CPU, world, None) == StepThreads(small, big)


def test_requested_count_is_fixed_and_gpu_keeps_torch_default() -> None:
    assert plan_step_threads(CPU, 1, 3) == StepThreads(3, 3)
    assert plan_step_threads(torch.device("cuda"), 1, None) is None
    assert StepThreads(1, 2).for_step(BIG_STEP_TOKENS - 1) == 1
    assert StepThreads(1, 2).for_step(BIG_STEP_TOKENS) == 2


def test_setter_switches_only_on_change(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    setter = ThreadSetter(StepThreads(1, 2))
    for tokens in (8, 8, 300, 256, 8, 64):
        setter.before_step(tokens)
    assert calls == [2, 1, 2]
    ThreadSetter(None).before_step(1000)
    assert calls == [2, 1, 2]
