"""Edges of the scheduler's behaviour, each pinned by the smallest case that reaches it."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from evenflow.core.sched import ledger as ledger_module
from evenflow.core.sched import scheduler as scheduler_module
from evenflow.protocol import ModelRunnerOutput, SpeculativeConfig

from .fake_model import FakeWorker
from .test_scheduler import add, make_scheduler, run_step, sample


def test_drafts_are_cut_at_max_model_len() -> None:
    """Draft slots stop where the tokens they may emit (1 + k) would pass max_model_len."""
    scheduler = make_scheduler(max_model_len=9, num_kv_blocks=4, block_size=4,
                               speculative_config=SpeculativeConfig("ngram", 3))
    request = add(scheduler, "a", 6)
    output = scheduler.schedule()
    scheduler.update_from_output(output, ModelRunnerOutput(output.step_id, ["a"], [[7]], num_proposed_drafts=[3]))
    assert request.num_tokens == 7 and request.num_proposed_drafts == 3
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"a": 2}  # position 6 and one draft: up to 9 tokens
    assert output.num_draft_slots == {"a": 1}
    assert request.num_computed_tokens == 8


def test_aborting_a_request_never_scheduled_reports_no_cached_tokens() -> None:
    scheduler = make_scheduler()
    add(scheduler, "a", 8)
    (out,) = scheduler.abort_requests(["a"])
    assert out.finish_reason == "abort" and out.num_cached_tokens == 0 and out.new_token_ids == []


def test_stats_report_prefix_cache_queries_and_hits() -> None:
    scheduler = make_scheduler(block_size=4)
    add(scheduler, "a", 8)
    scheduler.schedule()
    add(scheduler, "b", 8)
    scheduler.schedule()  # b finds a's first block; its last token is always recomputed
    stats = scheduler.get_stats()
    assert (stats.kv_cache.prefix_cache_queries, stats.kv_cache.prefix_cache_hits) == (16, 4)


def test_long_prefill_threshold_of_one_token_prefills_one_token_a_step() -> None:
    scheduler = make_scheduler(long_prefill_token_threshold=1)
    add(scheduler, "a", 3)
    assert [scheduler.schedule().num_scheduled_tokens for _ in range(3)] == [{"a": 1}] * 3


def test_abort_goes_past_unknown_ids_and_reports_each_prefix_hit() -> None:
    scheduler = make_scheduler(block_size=4)
    add(scheduler, "a", 10)
    scheduler.schedule()
    add(scheduler, "b", 10)
    scheduler.schedule()  # b finds a's two full blocks
    outputs = scheduler.abort_requests(["gone", "b", "never", "a"])
    assert [(o.request_id, o.finish_reason, o.num_cached_tokens) for o in outputs] == [("b", "abort", 8),
                                                                                       ("a", "abort", 0)]
    assert not scheduler.has_unfinished_requests()


def test_stats_count_running_waiting_kv_usage_and_every_preemption() -> None:
    scheduler = make_scheduler(num_kv_blocks=4, block_size=4, max_model_len=16)
    worker = FakeWorker(4, 4)
    for i in range(3):
        add(scheduler, f"r{i}", 3, arrival=float(i), max_tokens=9)
    run_step(scheduler, worker)  # the three prompts take three of the four blocks
    stats = scheduler.get_stats()
    assert (stats.scheduler.num_running, stats.scheduler.num_waiting, stats.scheduler.num_preemptions) == (3, 0, 0)
    assert stats.kv_cache.usage == scheduler.kv_cache_manager.usage > 0
    preempted = 0
    while scheduler.has_unfinished_requests():
        preempted += len(run_step(scheduler, worker).preempted_req_ids)
        stats = scheduler.get_stats()
        counts = stats.scheduler
        assert (counts.num_running, counts.num_waiting) == (len(scheduler.running), len(scheduler.waiting))
        assert stats.scheduler.num_preemptions == preempted
    assert preempted >= 2


def test_a_finished_request_leaves_running_when_a_preempted_one_finishes_after_it() -> None:
    """Overlap: a and b get their last tokens in step 1; step 2, scheduled before that output,
    preempts b for c. Applying step 1 then finishes a (running) and b (preempted), in that order."""
    scheduler = make_scheduler(num_kv_blocks=3, block_size=4, max_model_len=12)
    add(scheduler, "a", 3, max_tokens=2)
    add(scheduler, "c", 3, arrival=1.0)
    add(scheduler, "b", 3, arrival=2.0, max_tokens=2)
    first = scheduler.schedule()
    scheduler.update_from_output(first, sample(first, {}, scheduler))
    last = scheduler.schedule()
    assert last.num_scheduled_tokens == {"a": 1, "c": 1, "b": 1}
    in_flight = sample(last, {}, scheduler)
    assert scheduler.schedule().preempted_req_ids == ["b"]
    outputs = scheduler.update_from_output(last, in_flight)
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("a", "length"), ("c", None), ("b", "length")]
    assert [request.request_id for request in scheduler.running] == ["c"]


def test_a_request_preempted_with_drafts_in_flight_resumes_with_blocks_for_every_token() -> None:
    """Overlap: b's step with two draft slots is in flight when the next step preempts it; its
    drafts are then rejected. Stepping back over them is for running requests only: a preempted
    one has forgotten its progress, and resumes with blocks for all its tokens."""
    spec = SpeculativeConfig("ngram", 2, disable_by_batch_size=None)
    scheduler = make_scheduler(num_kv_blocks=3, block_size=4, max_model_len=12, speculative_config=spec)
    add(scheduler, "a", 3, max_tokens=4)
    b = add(scheduler, "b", 3, arrival=1.0, max_tokens=4)
    first = scheduler.schedule()
    scheduler.update_from_output(first, ModelRunnerOutput(first.step_id, ["a", "b"], [[5], [5]],
                                                          num_proposed_drafts=[0, 2]))
    drafting = scheduler.schedule()
    assert drafting.num_draft_slots == {"b": 2}
    following = scheduler.schedule()
    assert following.preempted_req_ids == ["b"]
    scheduler.update_from_output(drafting, ModelRunnerOutput(drafting.step_id, ["a", "b"], [[5], [5]],
                                                             num_proposed_drafts=[0, 0], num_draft_tokens=[0, 2]))
    assert b.num_computed_tokens == 0 and b.num_tokens == 5
    scheduler.update_from_output(following, sample(following, {}, scheduler))
    resumed = []
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        for cached in output.scheduled_cached_reqs:
            if cached.resumed_from_preemption:
                blocks = scheduler.kv_cache_manager.get_block_ids(cached.req_id)
                resumed.append((cached.num_computed_tokens + output.num_scheduled_tokens[cached.req_id],
                                len(blocks) * 4))
        scheduler.update_from_output(output, sample(output, {}, scheduler))
    assert resumed and all(end <= room for end, room in resumed), resumed


def test_running_decodes_take_the_budget_to_its_last_token_past_one_with_nothing_to_run() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=3)
    for i, max_tokens in enumerate((100, 2, 100)):
        add(scheduler, "abc"[i], 1, arrival=float(i), max_tokens=max_tokens)
    first = scheduler.schedule()
    scheduler.update_from_output(first, sample(first, {}, scheduler))
    second = scheduler.schedule()
    assert second.num_scheduled_tokens == {"a": 1, "b": 1, "c": 1}  # c takes the budget's last token
    # Overlap: b's last token is in flight, so b has nothing to run; c behind it still runs.
    assert scheduler.schedule().num_scheduled_tokens == {"a": 1, "c": 1}


def test_stats_add_up_the_time_of_every_schedule_and_update(monkeypatch: pytest.MonkeyPatch) -> None:
    ticks = iter(range(1000))
    fake_time = SimpleNamespace(perf_counter=lambda: float(next(ticks)), time=time.time)
    monkeypatch.setattr(scheduler_module, "time", fake_time)  # every measured span lasts 1 s
    monkeypatch.setattr(ledger_module, "time", fake_time)  # (update_from_output is timed there)
    scheduler = make_scheduler()
    add(scheduler, "a", 5)
    for _ in range(3):
        output = scheduler.schedule()
        scheduler.update_from_output(output, sample(output, {}, scheduler))
    stats = scheduler.get_stats()
    assert (stats.scheduler.schedule_s, stats.scheduler.update_s) == (3.0, 3.0)


def test_a_one_token_prefill_chunk_is_held_to_the_prefill_allowance_too() -> None:
    """With --target-itl-ms and a decode running, prompts get the controller's floor of 16 tokens
    a step: r0 and r1 take 8 each (the long-prefill threshold), and r2, admitted with the last
    token of the first step, gets none: a budget of 18 leaves it one token, over the allowance."""
    scheduler = make_scheduler(max_num_batched_tokens=18, target_itl_ms=50.0, long_prefill_token_threshold=8)
    add(scheduler, "d", 1)
    for i in range(3):
        add(scheduler, f"r{i}", 40, arrival=1.0 + i)
    worker = FakeWorker(64, 4)
    assert run_step(scheduler, worker).num_scheduled_tokens == {"d": 1, "r0": 8, "r1": 8, "r2": 1}
    for _ in range(2):
        assert run_step(scheduler, worker).num_scheduled_tokens == {"d": 1, "r0": 8, "r1": 8}


def test_fcfs_admits_in_arrival_order_whatever_the_priority_and_sends_the_params() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    low = add(scheduler, "low", 8, priority=5)
    add(scheduler, "high", 8, arrival=1.0, priority=0)
    (new,) = scheduler.schedule().scheduled_new_reqs  # the budget admits one: the first to arrive
    assert (new.req_id, new.prompt_token_ids, new.sampling_params) == ("low", list(low.prompt_token_ids),
                                                                        low.sampling_params)


def test_priority_policy_keeps_running_in_priority_order_so_a_later_urgent_request_is_not_the_victim() -> None:
    scheduler = make_scheduler(num_kv_blocks=8, max_model_len=32, policy="priority")
    worker = FakeWorker(8, 4)
    add(scheduler, "low", 14, priority=5)
    run_step(scheduler, worker)
    add(scheduler, "high", 14, arrival=1.0, priority=0, first_token=20)  # joins running after low
    preempted: list[str] = []
    while not preempted:
        preempted = run_step(scheduler, worker).preempted_req_ids
    assert preempted == ["low"]


def test_prefix_caching_off_finds_no_hit() -> None:
    scheduler = make_scheduler(block_size=4, enable_prefix_caching=False)
    add(scheduler, "a", 10)
    scheduler.schedule()
    add(scheduler, "b", 10)  # the same prompt
    (new,) = scheduler.schedule().scheduled_new_reqs
    assert new.num_computed_tokens == 0
    assert scheduler.get_stats().kv_cache.prefix_cache_hits == 0


def test_a_request_still_owed_a_token_does_not_hold_up_the_queue() -> None:
    """Two steps in flight: b, preempted by the second while its token from the first is still
    owed, waits for that token; c, behind it, is admitted meanwhile."""
    scheduler = make_scheduler(num_kv_blocks=3, block_size=4, max_model_len=12)
    add(scheduler, "a", 3)
    add(scheduler, "b", 5, arrival=1.0)
    first = scheduler.schedule()
    scheduler.update_from_output(first, sample(first, {}, scheduler))
    assert scheduler.schedule().num_scheduled_tokens == {"a": 1, "b": 1}
    assert scheduler.schedule().preempted_req_ids == ["b"]
    add(scheduler, "c", 3, arrival=2.0)
    assert [new.req_id for new in scheduler.schedule().scheduled_new_reqs] == ["c"]


def test_a_held_request_is_skipped_with_its_blocks_until_released() -> None:
    """Backpressure: ``hold_requests`` stops scheduling a request (running or waiting) without
    freeing its blocks; releasing it resumes it where it was. Unknown ids are ignored."""
    scheduler = make_scheduler()
    add(scheduler, "a", 5)
    add(scheduler, "b", 5)
    first = scheduler.schedule()
    scheduler.update_from_output(first, sample(first, {}, scheduler))
    blocks = list(scheduler.kv_cache_manager.get_block_ids("a"))
    computed = scheduler.requests["a"].num_computed_tokens
    scheduler.hold_requests(["a", "nobody"], True)
    add(scheduler, "c", 5)
    scheduler.hold_requests(["c"], True)
    for _ in range(2):
        held = scheduler.schedule()
        assert set(held.num_scheduled_tokens) == {"b"}  # neither the running a nor the waiting c
        scheduler.update_from_output(held, sample(held, {}, scheduler))
    assert scheduler.kv_cache_manager.get_block_ids("a") == blocks
    assert scheduler.requests["a"].num_computed_tokens == computed
    scheduler.hold_requests(["a", "c"], False)
    assert set(scheduler.schedule().num_scheduled_tokens) == {"a", "b", "c"}
