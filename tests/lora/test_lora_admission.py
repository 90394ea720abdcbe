"""The scheduler's LoRA admission (evenflow/core/sched/lora_slots.py): an adapter is loaded before its
first request runs, and at most max_loras adapters run at once; a request that would exceed it
waits with its place kept."""

from __future__ import annotations

from evenflow.core.request import Request, RequestStatus
from evenflow.core.sched.config import SchedulerConfig
from evenflow.core.sched.scheduler import Scheduler
from evenflow.protocol import ERR_INVALID_REQUEST, AdapterRef, ModelRunnerOutput, SamplingParams, SchedulerOutput

A, B, C = (AdapterRef(n, n * 8, f"/adapters/{n}", 4) for n in "abc")


def make_scheduler(max_loras: int) -> Scheduler:
    return Scheduler(SchedulerConfig(num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=128,
                                     block_size=4, max_loras=max_loras))


def add(sched: Scheduler, request_id: str, adapter: AdapterRef | None) -> Request:
    request = Request(request_id, [1, 2, 3, 4, 5], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    request.set_lora(adapter)
    sched.add_request(request)
    return request


def finish_step(sched: Scheduler, so: SchedulerOutput, **report: list[str]) -> None:
    ids = list(so.num_scheduled_tokens)
    sched.update_from_output(so, ModelRunnerOutput(so.step_id, ids, [[7] for _ in ids], **report))


def test_an_adapter_loads_before_its_first_request_runs() -> None:
    sched = make_scheduler(2)
    add(sched, "base", None)
    add(sched, "a1", A)
    so = sched.schedule()
    assert list(so.num_scheduled_tokens) == ["base"] and so.lora_prefetch == [A]
    finish_step(sched, so)
    so = sched.schedule()  # still loading: asked for once only
    assert "a1" not in so.num_scheduled_tokens and so.lora_prefetch == []
    finish_step(sched, so, lora_loaded=[A.identity])
    so = sched.schedule()
    assert "a1" in so.num_scheduled_tokens
    assert so.scheduled_new_reqs[0].lora == A


def test_at_most_max_loras_adapters_run_and_the_waiting_keep_their_place() -> None:
    sched = make_scheduler(2)
    for i, adapter in enumerate((A, B, C, A, None)):
        add(sched, f"r{i}-{adapter.name if adapter else 'base'}", adapter)
    so = sched.schedule()
    finish_step(sched, so, lora_loaded=[A.identity, B.identity, C.identity])
    so = sched.schedule()
    running = {r.request_id for r in sched.running}
    # C would be a third adapter: it waits; the A request and the base one behind it go ahead.
    assert running == {"r0-a", "r1-b", "r3-a", "r4-base"}
    assert [r.request_id for r in sched.waiting] == ["r2-c"]
    finish_step(sched, so)
    sched.abort_requests(["r1-b"])
    so = sched.schedule()
    assert "r2-c" in so.num_scheduled_tokens  # B's slot is free: C takes it
    assert len({r.lora.identity for r in sched.running if r.lora}) == 2


def test_an_adapter_that_fails_to_load_fails_its_requests_with_the_reason() -> None:
    sched = make_scheduler(2)
    base, bad, good = add(sched, "base", None), add(sched, "bad", A), add(sched, "good", B)
    so = sched.schedule()
    assert list(so.num_scheduled_tokens) == ["base"] and so.lora_prefetch == [A, B]
    finish_step(sched, so, lora_loaded=[B.identity], lora_failed=[A.identity], lora_failed_reasons=["OSError: gone"])
    (error,) = sched.take_grammar_failures()
    assert error.request_id == "bad" and "failed to load: OSError: gone" in error.message
    assert error.code == ERR_INVALID_REQUEST and bad.status == RequestStatus.FINISHED_ERROR
    # Only the failed adapter's requests: the base model's (running) and another adapter's (waiting) go on.
    assert base.status == RequestStatus.RUNNING and not good.is_finished
    assert "good" in sched.schedule().num_scheduled_tokens


def test_an_engine_without_lora_refuses_adapter_requests() -> None:
    sched = make_scheduler(0)
    request = Request("x", [1, 2], SamplingParams())
    request.set_lora(A)
    try:
        sched.add_request(request)
    except ValueError as e:
        assert "--enable-lora" in str(e)
    else:
        raise AssertionError("accepted")
    assert request.status == RequestStatus.WAITING
