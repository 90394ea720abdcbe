from __future__ import annotations

import pytest
from evenflow.core.sched.config import SchedulerConfig
from evenflow.core.request import Request, RequestStatus
from evenflow.core.sched.scheduler import Scheduler
from evenflow.protocol import ModelRunnerOutput, SamplingParams, SchedulerOutput, SpeculativeConfig, TokenLogprobs

from .fake_model import FakeWorker

EOS = 0


def make_scheduler(**overrides: object) -> Scheduler:
    options: dict[str, object] = dict(num_kv_blocks=64, max_num_batched_tokens=64, max_model_len=256, block_size=4)
    options.update(overrides)
    return Scheduler(SchedulerConfig(**options))  # type: ignore[arg-type]


def add(
    scheduler: Scheduler,
    request_id: str,
    prompt_len: int,
    arrival: float = 0.0,
    priority: int = 0,
    first_token: int = 1,
    **params: object,
) -> Request:
    params.setdefault("ignore_eos", True)
    params.setdefault("max_tokens", 100)
    request = Request(
        request_id,
        [first_token + i % 40 for i in range(prompt_len)],
        SamplingParams(**params),  # type: ignore[arg-type]
        eos_token_ids=(EOS,),
        arrival_time=arrival,
        priority=priority,
    )
    scheduler.add_request(request)
    return request


def sample(output: SchedulerOutput, tokens: dict[str, list[int]], scheduler: Scheduler) -> ModelRunnerOutput:
    """A scripted model: every request that reached its end samples the given tokens (or [5])."""
    req_ids, sampled = [], []
    for req_id in output.num_scheduled_tokens:
        request = scheduler.requests.get(req_id)
        produces = request is not None and request.num_output_placeholders > 0
        req_ids.append(req_id)
        sampled.append(tokens.get(req_id, [5]) if produces else [])
    return ModelRunnerOutput(output.step_id, req_ids, sampled)


def run_step(scheduler: Scheduler, worker: FakeWorker) -> SchedulerOutput:
    output = scheduler.schedule()
    scheduler.update_from_output(output, worker.execute(output))
    return output


def test_long_prompt_is_chunked_around_running_decodes() -> None:
    scheduler = make_scheduler(num_kv_blocks=400, max_model_len=1200)
    worker = FakeWorker(400, 4)
    decoders = [add(scheduler, f"d{i}", 5, arrival=i) for i in range(8)]
    run_step(scheduler, worker)  # 8 prompts of 5 tokens: one step
    assert all(request.num_output_tokens == 1 for request in decoders)
    long = add(scheduler, "long", 1000, arrival=100.0, first_token=100)
    steps = 0
    while long.num_output_tokens == 0:
        before = long.num_computed_tokens
        output = run_step(scheduler, worker)
        steps += 1
        assert all(output.num_scheduled_tokens[d.request_id] == 1 for d in decoders)
        assert output.num_scheduled_tokens["long"] == long.num_computed_tokens - before <= 64 - 8
        assert output.total_num_scheduled_tokens <= 64
    assert steps == -(-1000 // 56)  # the prompt used all the budget the decodes left
    assert all(request.num_output_tokens == 1 + steps for request in decoders)


def test_long_prefill_threshold_caps_chunks() -> None:
    scheduler = make_scheduler(long_prefill_token_threshold=10)
    add(scheduler, "a", 30)
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"a": 10}
    assert output.scheduled_new_reqs[0].num_computed_tokens == 0


def test_partial_chunk_samples_nothing_and_new_request_is_sent_once() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    request = add(scheduler, "a", 12)
    first = scheduler.schedule()
    assert [new.req_id for new in first.scheduled_new_reqs] == ["a"]
    assert len(first.scheduled_new_reqs[0].prompt_token_ids) == 12
    assert request.num_output_placeholders == 0
    scheduler.update_from_output(first, ModelRunnerOutput(first.step_id, ["a"], [[]]))
    second = scheduler.schedule()
    assert not second.scheduled_new_reqs and second.scheduled_cached_reqs[0].num_computed_tokens == 8
    assert second.num_scheduled_tokens == {"a": 4} and request.num_output_placeholders == 1


def test_preemption_by_recompute_and_resumption_from_prefix_cache() -> None:
    scheduler = make_scheduler(num_kv_blocks=8, max_model_len=32)  # 32 token slots
    worker = FakeWorker(8, 4)
    add(scheduler, "first", 14, arrival=0)
    second = add(scheduler, "second", 14, arrival=1, first_token=20)
    run_step(scheduler, worker)  # 4 + 4 blocks: the pool is full
    preempted_at = None
    for _ in range(4):
        output = run_step(scheduler, worker)
        if output.preempted_req_ids:
            preempted_at = output
            break
    assert preempted_at is not None and preempted_at.preempted_req_ids == ["second"]  # the latest
    assert second.status == RequestStatus.PREEMPTED and second.num_computed_tokens == 0
    assert not preempted_at.scheduled_new_reqs and scheduler.waiting.peek() is second
    assert scheduler.get_stats().scheduler.num_preemptions == 1
    scheduler.abort_requests(["first"])  # make room
    resumed = run_step(scheduler, worker)
    (data,) = resumed.scheduled_cached_reqs
    assert data.req_id == "second" and data.resumed_from_preemption
    assert data.new_block_ids == scheduler.kv_cache_manager.get_block_ids("second")
    assert data.num_computed_tokens == 12  # its full blocks were still cached
    assert resumed.num_scheduled_tokens["second"] == second.num_tokens - 1 - 12


def test_a_chunked_prompt_waits_until_the_pool_holds_all_of_it() -> None:
    # 16 blocks of 4 tokens. "running" holds 5 of them; "long" (48 tokens, 12 blocks) would fit its
    # first 16-token chunk in the 11 free blocks but not its whole prompt: admitted, it would take
    # the running request's blocks chunk by chunk and preempt it. It waits, and once the pool can
    # hold all of it (or nothing runs) it is admitted.
    scheduler = make_scheduler(num_kv_blocks=16, max_model_len=64, max_num_batched_tokens=16)
    worker = FakeWorker(16, 4)
    running = add(scheduler, "running", 16, max_tokens=8)
    run_step(scheduler, worker)
    run_step(scheduler, worker)  # a decode: 17 tokens, 5 blocks
    long = add(scheduler, "long", 48, first_token=20)
    steps = []
    while running.status == RequestStatus.RUNNING:
        steps.append(run_step(scheduler, worker))
    assert all("long" not in step.num_scheduled_tokens for step in steps)
    assert not any(step.preempted_req_ids for step in steps)
    assert running.num_output_tokens == 8 and long.status == RequestStatus.WAITING
    output = run_step(scheduler, worker)
    assert output.num_scheduled_tokens == {"long": 16}
    assert scheduler.get_stats().scheduler.num_preemptions == 0


def test_stats_count_a_prompt_once_and_every_scheduled_token() -> None:
    # Preemption and resumption: the prefix cache counts each prompt once (vLLM), while
    # scheduled_tokens counts the recomputation the resumption costs.
    scheduler = make_scheduler(num_kv_blocks=8, max_model_len=32)
    worker = FakeWorker(8, 4)
    add(scheduler, "first", 14, arrival=0)
    second = add(scheduler, "second", 14, arrival=1, first_token=20)
    total_scheduled = 0
    for _ in range(8):
        output = run_step(scheduler, worker)
        total_scheduled += output.total_num_scheduled_tokens
        if output.preempted_req_ids:
            break
    assert second.status == RequestStatus.PREEMPTED
    queries_before = scheduler.get_stats().kv_cache.prefix_cache_queries
    assert queries_before == 28  # both prompts, once each
    scheduler.abort_requests(["first"])
    resumed = run_step(scheduler, worker)  # "second" finds 12 of its tokens in the cache again
    total_scheduled += resumed.total_num_scheduled_tokens
    stats = scheduler.get_stats()
    assert resumed.scheduled_cached_reqs[0].resumed_from_preemption
    assert (stats.kv_cache.prefix_cache_queries, stats.kv_cache.prefix_cache_hits) == (queries_before, 0)
    # 28 prompt tokens, two decode steps of 2, one of 1 ("second" preempted), then "second"'s 17
    # tokens minus the 12 cached: 2 prompt tokens and its 3 output tokens computed again.
    assert resumed.num_scheduled_tokens["second"] == 5
    assert stats.scheduler.num_scheduled_tokens == total_scheduled == 28 + 2 + 2 + 1 + 5


def test_no_request_is_admitted_in_a_step_that_preempted() -> None:
    scheduler = make_scheduler(num_kv_blocks=8, max_model_len=32, policy="priority")
    worker = FakeWorker(8, 4)
    add(scheduler, "first", 14, arrival=0)
    add(scheduler, "second", 14, arrival=1, first_token=20)
    for _ in range(3):  # prefill both (4 + 4 blocks), then two decodes fill the last slots
        assert not run_step(scheduler, worker).preempted_req_ids
    add(scheduler, "urgent", 4, arrival=2, priority=-1, first_token=30)  # fits once "second" is out
    output = run_step(scheduler, worker)
    assert output.preempted_req_ids == ["second"]
    assert set(output.num_scheduled_tokens) == {"first"}
    assert [new.req_id for new in run_step(scheduler, worker).scheduled_new_reqs] == ["urgent"]


def test_priority_policy_admits_and_preempts_by_priority() -> None:
    scheduler = make_scheduler(num_kv_blocks=8, max_model_len=32, policy="priority", max_num_seqs=2)
    worker = FakeWorker(8, 4)
    add(scheduler, "low", 14, arrival=0, priority=5)
    add(scheduler, "high", 14, arrival=1, priority=0, first_token=20)
    add(scheduler, "highest-late", 4, arrival=2, priority=-1, first_token=30)
    output = run_step(scheduler, worker)
    assert [new.req_id for new in output.scheduled_new_reqs] == ["highest-late", "high"]
    scheduler.abort_requests(["highest-late"])
    output = run_step(scheduler, worker)  # "low" comes in
    assert "low" in output.num_scheduled_tokens
    for _ in range(4):
        output = run_step(scheduler, worker)
        if output.preempted_req_ids:
            break
    assert output.preempted_req_ids == ["low"]  # arrived first, but the lowest priority


def test_max_num_seqs_caps_running_requests() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    for i in range(4):
        add(scheduler, f"r{i}", 3, arrival=i)
    output = scheduler.schedule()
    assert set(output.num_scheduled_tokens) == {"r0", "r1"}
    assert (scheduler.num_running, scheduler.num_waiting) == (2, 2)


def test_abort_waiting_running_and_in_flight() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    running = add(scheduler, "running", 6)
    add(scheduler, "waiting", 6)
    output = scheduler.schedule()
    aborted = scheduler.abort_requests(["waiting", "running", "unknown"])
    assert [(o.request_id, o.finish_reason, o.new_token_ids) for o in aborted] == [
        ("waiting", "abort", []),
        ("running", "abort", []),
    ]
    assert running.status == RequestStatus.FINISHED_ABORTED
    assert scheduler.kv_cache_manager.num_free_blocks == 64 and not scheduler.has_unfinished_requests()
    assert scheduler.update_from_output(output, sample(output, {}, scheduler)) == []  # in-flight step ignored
    assert scheduler.update_from_output(output, ModelRunnerOutput(output.step_id, ["running"], [[5]])) == []
    assert scheduler.schedule().finished_req_ids == ["running"]  # "waiting" never reached a worker


@pytest.mark.parametrize(
    ("params", "tokens", "expected_tokens", "reason", "stop_reason"),
    [
        (dict(max_tokens=10), [7, EOS, 7], [7, EOS], "stop", None),
        (dict(max_tokens=10, ignore_eos=True), [7, EOS, 7], [7, EOS, 7], None, None),
        (dict(max_tokens=10, stop_token_ids=[9]), [7, 9], [7, 9], "stop", 9),
        (dict(max_tokens=10, min_tokens=3), [EOS, EOS, EOS], [EOS, EOS, EOS], "stop", None),
        (dict(max_tokens=10, min_tokens=3, stop_token_ids=[9]), [9, 9, 7, 9], [9, 9, 7, 9], "stop", 9),
        (dict(max_tokens=2), [7, 7], [7, 7], "length", None),
        (dict(max_tokens=100), [7] * 5, [7] * 4, "length", None),  # max_model_len = 8, prompt 4
    ],
)
def test_stop_checks(
    params: dict, tokens: list[int], expected_tokens: list[int], reason: str | None, stop_reason: int | None
) -> None:
    scheduler = make_scheduler(max_model_len=8, num_kv_blocks=4)
    params.setdefault("ignore_eos", False)
    add(scheduler, "a", 4, **params)
    got: list[int] = []
    final = None
    for token in tokens:
        output = scheduler.schedule()
        if "a" not in output.num_scheduled_tokens:
            break
        for out in scheduler.update_from_output(output, sample(output, {"a": [token]}, scheduler)):
            got.extend(out.new_token_ids)
            final = out
    assert got == expected_tokens
    assert final is not None and final.finish_reason == reason and final.stop_reason == stop_reason
    assert scheduler.has_unfinished_requests() == (reason is None)


def test_outputs_carry_logprobs_and_cached_tokens() -> None:
    scheduler = make_scheduler()
    add(scheduler, "a", 9)
    output = scheduler.schedule()
    scheduler.update_from_output(output, ModelRunnerOutput(output.step_id, ["a"], [[3]]))
    add(scheduler, "b", 9)
    output = scheduler.schedule()
    logprobs = TokenLogprobs([4], [-0.5], 1)
    (out,) = scheduler.update_from_output(output, ModelRunnerOutput(output.step_id, ["b"], [[4]], [[logprobs]]))
    assert out.num_cached_tokens == 8 and out.logprobs == [logprobs]


def test_draft_slots_count_in_the_budget_and_are_trimmed() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=3, speculative_config=SpeculativeConfig("ngram", 3))
    request = add(scheduler, "a", 2)
    output = scheduler.schedule()
    scheduler.update_from_output(output, ModelRunnerOutput(output.step_id, ["a"], [[7]], num_proposed_drafts=[3]))
    assert request.num_proposed_drafts == 3
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"a": 3}  # the last token + 2 drafts: the budget cut one
    assert output.num_draft_slots == {"a": 2}  # the worker fills them
    assert request.num_computed_tokens == 5 and request.num_output_placeholders == 3
    # One draft accepted, then a bonus token: the rejected draft's position is recomputed.
    scheduler.update_from_output(
        output, ModelRunnerOutput(output.step_id, ["a"], [[1, 8]], num_proposed_drafts=[0], num_draft_tokens=[2])
    )
    assert list(request.output_token_ids) == [7, 1, 8] and request.num_output_placeholders == 0
    assert request.num_computed_tokens == 4 == request.num_tokens - 1 and request.num_proposed_drafts == 0
    stats = scheduler.get_stats()
    assert (stats.spec_decode.num_drafts, stats.spec_decode.num_draft_tokens) == (1, 2)
    assert stats.spec_decode.num_accepted_tokens == 1 and stats.spec_decode.num_accepted_tokens_per_pos == [1, 0]


def test_with_a_step_in_flight_k_slots_are_reserved_and_none_past_max_tokens() -> None:
    scheduler = make_scheduler(speculative_config=SpeculativeConfig("ngram", 4))
    request = add(scheduler, "a", 5, max_tokens=4)
    scheduler.schedule()  # the prompt; its token is in flight
    step1 = scheduler.schedule()
    # 1 + K would emit up to 5 tokens, with 1 in flight and max_tokens 4: 2 slots at most.
    assert step1.num_draft_slots == {"a": 2} and request.num_output_placeholders == 4


def test_no_drafts_once_disable_by_batch_size_requests_run() -> None:
    spec = SpeculativeConfig("ngram", 3, disable_by_batch_size=2)
    scheduler = make_scheduler(speculative_config=spec)
    add(scheduler, "a", 5)
    scheduler.schedule()
    assert scheduler.schedule().num_draft_slots == {"a": 3}
    add(scheduler, "b", 5)
    scheduler.schedule()  # admits b
    assert scheduler.schedule().num_draft_slots == {}


# ------------------------------------------------------------------------------- overlap


def test_next_decode_is_scheduled_before_the_previous_token_is_known() -> None:
    scheduler = make_scheduler()
    request = add(scheduler, "a", 5)
    step0 = scheduler.schedule()
    step1 = scheduler.schedule()  # step 0's token is not back yet
    assert step1.num_scheduled_tokens == {"a": 1} and step1.scheduled_cached_reqs[0].num_computed_tokens == 5
    assert request.num_output_placeholders == 2 and request.num_computed_tokens == 6
    scheduler.update_from_output(step0, ModelRunnerOutput(step0.step_id, ["a"], [[7]]))
    assert request.num_output_placeholders == 1 and list(request.output_token_ids) == [7]
    scheduler.update_from_output(step1, ModelRunnerOutput(step1.step_id, ["a"], [[8]]))
    assert request.num_output_placeholders == 0 and list(request.output_token_ids) == [7, 8]


def test_no_work_is_scheduled_for_tokens_that_will_surely_finish_the_request() -> None:
    scheduler = make_scheduler()
    add(scheduler, "a", 5, max_tokens=1)
    step0 = scheduler.schedule()
    assert scheduler.schedule().num_scheduled_tokens == {}  # its only token is in flight
    (out,) = scheduler.update_from_output(step0, ModelRunnerOutput(step0.step_id, ["a"], [[7]]))
    assert out.finish_reason == "length" and scheduler.schedule().finished_req_ids == ["a"]


def test_no_work_is_scheduled_past_max_model_len_while_tokens_are_in_flight() -> None:
    scheduler = make_scheduler(max_model_len=8, num_kv_blocks=4)
    add(scheduler, "a", 6)
    assert scheduler.schedule().num_scheduled_tokens == {"a": 6}
    assert scheduler.schedule().num_scheduled_tokens == {"a": 1}  # position 6, token in flight
    assert scheduler.schedule().num_scheduled_tokens == {}  # 6 + 2 in flight = max_model_len


def test_preempted_request_waits_for_its_in_flight_token() -> None:
    scheduler = make_scheduler(num_kv_blocks=8, max_model_len=32)
    worker = FakeWorker(8, 4)
    add(scheduler, "first", 15, arrival=0)
    second = add(scheduler, "second", 15, arrival=1, first_token=20)
    step = scheduler.schedule()
    pending = (step, worker.execute(step))
    preempted = False
    for _ in range(6):
        step = scheduler.schedule()
        mro = worker.execute(step)
        if step.preempted_req_ids:
            preempted = True
            assert second.status == RequestStatus.PREEMPTED and second.num_output_placeholders == 1
            break
        scheduler.update_from_output(*pending)
        pending = (step, mro)
    assert preempted
    scheduler.abort_requests(["first"])
    blocked = scheduler.schedule()
    assert blocked.num_scheduled_tokens == {}  # its token from the in-flight step is owed
    tokens_before = second.num_tokens
    scheduler.update_from_output(*pending)  # the preempted request still takes that token
    assert second.num_tokens == tokens_before + 1 and second.num_output_placeholders == 0
    assert "second" in run_step(scheduler, worker).num_scheduled_tokens


def test_output_of_an_older_request_with_a_reused_id_is_ignored() -> None:
    scheduler = make_scheduler()
    add(scheduler, "a", 5)
    old = scheduler.schedule()
    scheduler.abort_requests(["a"])
    reused = add(scheduler, "a", 5)
    assert scheduler.update_from_output(old, ModelRunnerOutput(old.step_id, ["a"], [[7]])) == []
    new = scheduler.schedule()
    assert new.finished_req_ids == ["a"] and [r.req_id for r in new.scheduled_new_reqs] == ["a"]
    assert scheduler.update_from_output(old, ModelRunnerOutput(old.step_id, ["a"], [[7]])) == []
    assert reused.num_output_tokens == 0 and reused.num_output_placeholders == 1


# ------------------------------------------------------------------------------- bookkeeping


def test_stats() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    worker = FakeWorker(64, 4)
    add(scheduler, "a", 12, max_tokens=3)
    while scheduler.has_unfinished_requests():
        run_step(scheduler, worker)
    scheduler.schedule()  # nothing to run: not a step
    stats = scheduler.get_stats()
    counts = stats.scheduler
    assert (counts.num_prompt_tokens, counts.num_generation_tokens, counts.num_steps) == (12, 3, 4)
    assert stats.scheduler.num_running == stats.scheduler.num_waiting == 0 and stats.kv_cache.usage == 0.0
    assert stats.scheduler.schedule_s > 0 and stats.scheduler.update_s > 0


def test_add_request_rejects_duplicates_and_bad_prompts() -> None:
    scheduler = make_scheduler(max_model_len=16)
    add(scheduler, "a", 4)
    with pytest.raises(ValueError, match="already"):
        add(scheduler, "a", 4)
    with pytest.raises(ValueError, match="max_model_len"):
        add(scheduler, "b", 17)
    with pytest.raises(ValueError):
        scheduler.add_request(Request("c", [], SamplingParams()))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(num_kv_blocks=0), "num_kv_blocks"),
        (dict(max_num_batched_tokens=0), "--max-num-batched-tokens"),
        (dict(policy="lifo"), "--scheduling-policy must be one of fcfs, priority"),
        (dict(long_prefill_token_threshold=-1), "--long-prefill-token-threshold"),
        (dict(block_size=12), "power of two"),
        (dict(num_kv_blocks=3, block_size=16, max_model_len=64), "max_model_len"),
    ],
)
def test_config_validation(overrides: dict, message: str) -> None:
    options: dict[str, object] = dict(num_kv_blocks=100)
    options.update(overrides)
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**options).validate()  # type: ignore[arg-type]


def test_defaults_follow_vllm_online_serving() -> None:
    config = SchedulerConfig(num_kv_blocks=1000)
    config.validate()
    assert (config.max_num_batched_tokens, config.max_num_seqs, config.block_size) == (2048, 256, 16)
    assert (config.long_prefill_token_threshold, config.policy, config.enable_prefix_caching) == (0, "fcfs", True)


def test_reset_prefix_cache() -> None:
    scheduler = make_scheduler()
    add(scheduler, "a", 9)
    output = scheduler.schedule()
    scheduler.update_from_output(output, ModelRunnerOutput(output.step_id, ["a"], [[3]]))
    assert scheduler.reset_prefix_cache()
    add(scheduler, "b", 9)
    assert scheduler.schedule().scheduled_new_reqs[0].num_computed_tokens == 0


def test_first_output_carries_queue_time_only_once() -> None:
    import time

    scheduler = make_scheduler(max_num_batched_tokens=8)
    arrival = time.time() - 2.0  # arrived two seconds ago
    add(scheduler, "a", 12, arrival=arrival)
    so = scheduler.schedule()  # a partial chunk: no output yet
    assert scheduler.update_from_output(so, sample(so, {}, scheduler)) == []
    so = scheduler.schedule()
    (first,) = scheduler.update_from_output(so, sample(so, {}, scheduler))
    assert first.queue_time_s is not None and 2.0 <= first.queue_time_s < 60.0
    so = scheduler.schedule()
    (second,) = scheduler.update_from_output(so, sample(so, {}, scheduler))
    assert second.new_token_ids == [5] and second.queue_time_s is None
