"""Drive a Scheduler with a FakeWorker, checking its invariants after every step.

``max_in_flight=1`` applies each step's output before the next ``schedule()``; ``2`` keeps two
steps in flight like the engine's overlap loop: step N+1 is scheduled before step N's tokens are
applied.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from evenflow.core.request import Request, RequestStatus
from evenflow.core.sched.scheduler import Scheduler
from evenflow.protocol import ModelRunnerOutput, RequestOutput, SamplingParams, SchedulerOutput

from .fake_model import EOS_TOKEN_ID, FakeWorker


@dataclass
class PlannedRequest:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrival_step: int = 0
    priority: int = 0
    abort_step: int | None = None  # abort it at this step, if still unfinished


@dataclass
class RunResult:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finish_reasons: dict[str, str] = field(default_factory=dict)
    num_steps: int = 0
    outputs: list[SchedulerOutput] = field(default_factory=list)


def check_invariants(scheduler: Scheduler, output: SchedulerOutput) -> None:
    """What must hold after every schedule() call."""
    config = scheduler.config
    kv = scheduler.kv_cache_manager
    assert sum(output.num_scheduled_tokens.values()) == output.total_num_scheduled_tokens
    assert output.total_num_scheduled_tokens <= config.max_num_batched_tokens
    assert all(num > 0 for num in output.num_scheduled_tokens.values()), output.num_scheduled_tokens
    spec = config.speculative_config
    for req_id, slots in output.scheduled_spec_decode_tokens.items():
        assert spec is not None and 0 < len(slots) <= spec.num_speculative_tokens
        assert output.num_scheduled_tokens[req_id] > len(slots)  # drafts ride on a sampling token
    assert scheduler.num_running <= config.max_num_seqs
    for req_id in output.num_scheduled_tokens:
        request = scheduler.requests[req_id]
        assert request.status == RequestStatus.RUNNING
        assert request.num_computed_tokens <= config.max_model_len, request
    for request in scheduler.running:
        assert request.status == RequestStatus.RUNNING
        assert len(kv.get_blocks(request.request_id)) * config.block_size >= request.num_computed_tokens, request
    for request in scheduler.waiting:
        assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED, RequestStatus.WAITING_FOR_FSM)
        assert request.request_id not in kv.req_to_blocks, f"{request} holds blocks while waiting"
    # Ref counts equal the number of block tables holding each block; free == ref 0.
    holders = Counter(block.block_id for blocks in kv.req_to_blocks.values() for block in blocks)
    pool = kv.pool
    free_ids = pool.free_queue.block_ids()
    assert len(free_ids) == len(set(free_ids)) == pool.num_free_blocks
    free_set = set(free_ids)
    for block in pool.blocks:
        assert block.ref_cnt >= 0
        assert block.ref_cnt == holders.get(block.block_id, 0), block
        assert (block.ref_cnt == 0) == (block.block_id in free_set), block
        if block.block_hash is not None:
            assert pool.cached_blocks[block.block_hash] is block
    assert len(pool.cached_blocks) == sum(block.block_hash is not None for block in pool.blocks)


def run_workload(
    scheduler: Scheduler, plan: list[PlannedRequest], max_in_flight: int = 1, max_steps: int = 20_000,
    step_seconds: Callable[[SchedulerOutput], float] | None = None,
) -> RunResult:
    """Run every planned request to the end; return tokens and finish reasons per request.
    ``step_seconds``: the forward time each step reports (a synthetic machine), else 0."""
    config = scheduler.config
    spec = config.speculative_config
    worker = FakeWorker(config.num_kv_blocks, config.block_size, spec.num_speculative_tokens if spec else 0)
    result = RunResult()
    pending: list[tuple[SchedulerOutput, ModelRunnerOutput]] = []

    def collect(outputs: list[RequestOutput]) -> None:
        for out in outputs:
            assert out.request_id not in result.finish_reasons, f"{out.request_id} output after finishing"
            result.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                result.finish_reasons[out.request_id] = out.finish_reason

    step = 0
    while step == 0 or scheduler.has_unfinished_requests() or pending or any(p.arrival_step >= step for p in plan):
        assert step < max_steps, "the scheduler stopped making progress"
        for planned in plan:
            if planned.arrival_step == step:
                scheduler.add_request(
                    Request(
                        planned.request_id,
                        planned.prompt,
                        planned.params,
                        eos_token_ids=(EOS_TOKEN_ID,),
                        arrival_time=float(step),
                        priority=planned.priority,
                    )
                )
            if planned.abort_step == step:
                collect(scheduler.abort_requests([planned.request_id]))
        output = scheduler.schedule()
        check_invariants(scheduler, output)
        result.outputs.append(output)
        mro = worker.execute(output)
        if step_seconds is not None:
            mro.forward_s = step_seconds(output)
        pending.append((output, mro))
        while len(pending) >= max_in_flight or (pending and not scheduler.has_unfinished_requests()):
            collect(scheduler.update_from_output(*pending.pop(0)))
        step += 1
    result.num_steps = step
    kv = scheduler.kv_cache_manager
    assert not kv.req_to_blocks, "block tables left after every request finished"
    assert not kv.num_cached_blocks, "per-request cache bookkeeping left after every request finished"
    assert kv.num_free_blocks == config.num_kv_blocks, "blocks leaked"
    return result
