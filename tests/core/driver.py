"""Drive a Scheduler through the engine's step loop with a FakeWorker, checking the scheduler's
invariants on every step the loop sends.

``max_in_flight=1`` applies each step's output before the next ``schedule()``; ``2`` is the
loop's async scheduling: step N+1 is scheduled before step N's tokens are applied.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from evenflow.core.engine_loop import EngineLoop
from evenflow.core.request import Request, RequestStatus
from evenflow.core.sched.scheduler import Scheduler
from evenflow.protocol import ModelRunnerOutput, RequestOutput, SamplingParams, SchedulerOutput, WorkerReady

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
    outputs: list[SchedulerOutput] = field(default_factory=list)  # every step the loop sent


def check_invariants(scheduler: Scheduler, output: SchedulerOutput) -> None:
    """What must hold after every schedule() call."""
    config = scheduler.config
    kv = scheduler.kv_cache_manager
    assert sum(output.num_scheduled_tokens.values()) == output.total_num_scheduled_tokens
    assert output.total_num_scheduled_tokens <= config.max_num_batched_tokens
    assert all(num > 0 for num in output.num_scheduled_tokens.values()), output.num_scheduled_tokens
    spec = config.speculative_config
    for req_id, num_slots in output.num_draft_slots.items():
        assert spec is not None and 0 < num_slots <= spec.num_speculative_tokens
        assert output.num_scheduled_tokens[req_id] > num_slots  # drafts ride on a sampling token
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


class FakeExecutor:
    """A FakeWorker behind the Executor interface; checks the invariants on every step it is sent
    (the loop sends right after ``schedule()``). ``step_seconds``: each step's forward time."""

    def __init__(self, scheduler: Scheduler, step_seconds: Callable[[SchedulerOutput], float] | None) -> None:
        config = scheduler.config
        spec = config.speculative_config
        self.scheduler = scheduler
        self.worker = FakeWorker(config.num_kv_blocks, config.block_size, spec.num_speculative_tokens if spec else 0)
        self.step_seconds = step_seconds
        self.steps: list[SchedulerOutput] = []
        self._outputs: deque[ModelRunnerOutput] = deque()

    def start(self) -> list[WorkerReady]:
        config = self.scheduler.config
        return [WorkerReady(0, config.num_kv_blocks, config.block_size, "fake", "int", "none")]

    def init_kv_cache(self, num_blocks: int) -> None:
        pass

    def send_step(self, so: SchedulerOutput) -> None:
        check_invariants(self.scheduler, so)
        self.steps.append(so)
        mro = self.worker.execute(so)
        if self.step_seconds is not None:
            mro.forward_s = self.step_seconds(so)
        self._outputs.append(mro)

    def recv_output(self, step_id: int) -> ModelRunnerOutput:
        mro = self._outputs.popleft()
        assert mro.step_id == step_id
        return mro

    def check_alive(self) -> None:
        pass

    def shutdown(self, timeout: float = 5.0) -> None:
        pass


def run_workload(
    scheduler: Scheduler, plan: list[PlannedRequest], max_in_flight: int = 1, max_steps: int = 20_000,
    step_seconds: Callable[[SchedulerOutput], float] | None = None,
) -> RunResult:
    """Run every planned request to the end; return tokens and finish reasons per request.
    ``step_seconds``: the forward time each step reports (a synthetic machine), else 0.
    ``arrival_step`` and ``abort_step`` count loop steps."""
    assert max_in_flight in (1, 2), "the engine loop keeps one or two steps in flight"
    config = scheduler.config
    executor = FakeExecutor(scheduler, step_seconds)
    loop = EngineLoop(scheduler, executor, async_scheduling=max_in_flight == 2)
    result = RunResult()

    def collect(outputs: list[RequestOutput]) -> None:
        for out in outputs:
            assert out.request_id not in result.finish_reasons, f"{out.request_id} output after finishing"
            result.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                result.finish_reasons[out.request_id] = out.finish_reason

    step = 0
    while step == 0 or loop.has_work() or any(p.arrival_step >= step for p in plan):
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
        collect(loop.step().outputs or [])
        step += 1
    result.num_steps = step
    result.outputs = executor.steps
    kv = scheduler.kv_cache_manager
    assert not kv.req_to_blocks, "block tables left after every request finished"
    assert not kv.num_cached_blocks, "per-request cache bookkeeping left after every request finished"
    assert kv.num_free_blocks == config.num_kv_blocks, "blocks leaked"
    return result
