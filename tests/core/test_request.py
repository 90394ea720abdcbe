from __future__ import annotations

import time

import pytest
from evenflow.core.request import FCFSQueue, PriorityQueue, Request, RequestStatus
from evenflow.protocol import SamplingParams


def make_request(request_id: str = "r", prompt: list[int] | None = None, **kwargs: object) -> Request:
    return Request(request_id, prompt or [1, 2, 3], SamplingParams(), **kwargs)  # type: ignore[arg-type]


def test_append_updates_output_and_all_tokens_together() -> None:
    request = make_request(prompt=[5, 6])
    request.append_output_token_ids(7)
    request.append_output_token_ids([8, 9])
    assert list(request.all_token_ids) == [5, 6, 7, 8, 9]
    assert list(request.output_token_ids) == [7, 8, 9]
    assert list(request.prompt_token_ids) == [5, 6]
    assert (request.num_tokens, request.num_output_tokens, request.num_prompt_tokens) == (5, 3, 2)
    request.num_proposed_drafts = 2
    assert request.num_tokens_with_spec == 7


def test_views_are_read_only_and_prompt_is_copied() -> None:
    prompt = [1, 2, 3]
    request = make_request(prompt=prompt)
    prompt.append(4)  # the caller's list is not the request's
    assert request.num_tokens == 3
    view = request.all_token_ids
    with pytest.raises((TypeError, AttributeError)):
        view[0] = 9  # type: ignore[index]
    with pytest.raises(AttributeError):
        view.append(9)  # type: ignore[attr-defined]
    sliced = view[:2]
    sliced.append(99)  # a slice is a copy
    assert list(view) == [1, 2, 3]
    assert view == [1, 2, 3] and 2 in view and view[-1] == 3


def test_phase_is_derived_from_num_computed_tokens() -> None:
    request = make_request(prompt=[1, 2, 3, 4])
    assert request.is_prefilling
    request.num_computed_tokens = 4
    assert not request.is_prefilling


def test_status_helpers_and_finish_reasons() -> None:
    unfinished = [RequestStatus.WAITING, RequestStatus.WAITING_FOR_FSM, RequestStatus.RUNNING, RequestStatus.PREEMPTED]
    assert not any(RequestStatus.is_finished(s) for s in unfinished)
    assert all(RequestStatus.finish_reason(s) is None for s in unfinished)
    expected = {
        RequestStatus.FINISHED_STOPPED: "stop",
        RequestStatus.FINISHED_LENGTH: "length",
        RequestStatus.FINISHED_ABORTED: "abort",
        RequestStatus.FINISHED_ERROR: "error",
    }
    for status, reason in expected.items():
        assert RequestStatus.is_finished(status)
        request = make_request()
        request.status = status
        assert request.is_finished and request.finish_reason == reason


def test_fcfs_queue_front_insertion() -> None:
    queue = FCFSQueue()
    a, b, c = make_request("a"), make_request("b"), make_request("c")
    queue.add(a)
    queue.add(b)
    queue.add_front(c)
    assert [r.request_id for r in queue] == ["c", "a", "b"]
    queue.remove(a)
    assert queue.pop() is c and queue.peek() is b and len(queue) == 1


def test_priority_queue_orders_by_priority_then_arrival() -> None:
    queue = PriorityQueue()
    queue.add(make_request("late-high", priority=0, arrival_time=5.0))
    queue.add(make_request("low", priority=2, arrival_time=0.0))
    queue.add(make_request("early-high", priority=0, arrival_time=1.0))
    queue.add(make_request("mid", priority=1, arrival_time=0.5))
    assert [r.request_id for r in queue] == ["early-high", "late-high", "mid", "low"]
    queue.remove(next(r for r in queue if r.request_id == "mid"))
    assert [queue.pop().request_id for _ in range(3)] == ["early-high", "late-high", "low"]


def test_token_views_compare_by_content() -> None:
    request = make_request(prompt=[5, 6])
    assert request.prompt_token_ids == make_request(prompt=[5, 6]).prompt_token_ids
    assert request.prompt_token_ids != make_request(prompt=[5, 7]).prompt_token_ids
    assert request.prompt_token_ids == [5, 6] and request.prompt_token_ids != [5]


def test_defaults_arrive_now_with_vllm_priority_zero() -> None:
    before = time.time()
    request = make_request()
    assert before <= request.arrival_time <= time.time()
    # Priority 0 by default (vLLM's): an earlier request that asked for priority 1 goes after it.
    queue = PriorityQueue()
    queue.add(make_request("explicit-1", priority=1, arrival_time=0.0))
    queue.add(make_request("default", arrival_time=1.0))
    assert [r.request_id for r in queue] == ["default", "explicit-1"]
