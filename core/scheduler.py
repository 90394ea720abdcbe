"""The scheduler: one token budget per step, shared by decodes and chunked prefills.

Each step, RUNNING requests are served first, in order, each with as many of its remaining tokens
as the budget allows; then, only if nobody had to be preempted, WAITING requests are admitted.
When the KV cache cannot hold a chunk, the last RUNNING request (latest admitted under ``fcfs``,
lowest priority under ``priority``) is preempted by recompute.

``schedule()`` advances ``num_computed_tokens`` at once and counts a placeholder for every token
the step will sample, so the next step can be scheduled before this one's tokens are known (the
workers fill those inputs from their own last sample). ``update_from_output()`` applies a step's
tokens, possibly after a later step was scheduled, and runs the stop checks.
"""

from __future__ import annotations

import time
from bisect import insort
from collections.abc import Iterable

from evenflow.protocol import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    RequestOutput,
    SchedulerOutput,
    SchedulerStats,
)

from .config import SchedulerConfig
from .kv_cache_manager import KVCacheManager
from .request import FCFSQueue, PriorityQueue, Request, RequestStatus, WaitingQueue


class Scheduler:
    """Decides, step by step, which requests run and how many of their tokens."""

    def __init__(self, config: SchedulerConfig) -> None:
        config.validate()
        self.config = config
        self.kv_cache_manager = KVCacheManager(config.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.waiting: WaitingQueue = PriorityQueue() if config.policy == "priority" else FCFSQueue()
        # Kept in policy order, so the request to preempt is always the last one.
        self.running: list[Request] = []
        self._finished_req_ids: list[str] = []  # for the next SchedulerOutput
        self._next_step_id = 0
        self._num_steps = 0
        self._num_preemptions = 0
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._num_scheduled_tokens = 0  # every step's scheduled tokens, recomputation included
        self._schedule_s = 0.0
        self._update_s = 0.0

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def add_request(self, request: Request) -> None:
        """Queue a new request; raises ValueError for a duplicate id or an unusable prompt."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if not 0 < request.num_prompt_tokens <= self.config.max_model_len:
            raise ValueError(
                f"prompt of {request.num_prompt_tokens} tokens: must be 1..max_model_len={self.config.max_model_len}"
            )
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        """Finish the known ones as aborted (blocks freed at once); unknown ids are ignored."""
        outputs = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            self._finish(request, RequestStatus.FINISHED_ABORTED)
            outputs.append(RequestOutput(request_id, [], "abort", request.num_cached_tokens))
        return outputs

    def schedule(self) -> SchedulerOutput:
        """Plan the next step: which requests run, how many tokens each, with which blocks."""
        start = time.perf_counter()
        config = self.config
        kv = self.kv_cache_manager
        step_id = self._next_step_id
        self._next_step_id += 1
        token_budget = config.max_num_batched_tokens
        num_scheduled_tokens: dict[str, int] = {}
        spec_decode_tokens: dict[str, list[int]] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted_req_ids: list[str] = []

        # 1. RUNNING requests, in order. A victim is always behind the current index, so
        #    nothing scheduled earlier in this step is ever taken back.
        running = self.running
        index = 0
        while index < len(running) and token_budget > 0:
            request = running[index]
            num_new = self._num_new_tokens_running(request, token_budget)
            if num_new <= 0:
                index += 1
                continue
            new_blocks = kv.allocate_slots(request, num_new)
            while new_blocks is None:
                victim = running.pop()
                self._preempt(victim)
                preempted_req_ids.append(victim.request_id)
                if victim is request:
                    break
                new_blocks = kv.allocate_slots(request, num_new)
            if new_blocks is None:
                break  # the request itself was the last one running
            req_id = request.request_id
            if request.spec_token_ids:
                # Drafts sit after the known tokens; the budget may cut some or all of them.
                num_spec = request.num_computed_tokens + num_new - request.num_tokens
                del request.spec_token_ids[max(num_spec, 0) :]
                if num_spec > 0:
                    spec_decode_tokens[req_id] = list(request.spec_token_ids)
            new_block_ids = [block.block_id for block in new_blocks] if new_blocks else []
            cached_reqs.append(CachedRequestData(req_id, new_block_ids, request.num_computed_tokens))
            num_scheduled_tokens[req_id] = num_new
            token_budget -= num_new
            self._advance(request, num_new)
            index += 1

        # 2. WAITING requests, only when nobody was preempted (they would just preempt back).
        if not preempted_req_ids:
            skipped: list[Request] = []
            while self.waiting and token_budget > 0 and len(self.running) < config.max_num_seqs:
                request = self.waiting.peek()
                if request.num_output_placeholders > 0 or request.status == RequestStatus.WAITING_FOR_FSM:
                    # A token of an in-flight step is still owed to it, or its grammar compiles.
                    skipped.append(self.waiting.pop())
                    continue
                computed = kv.get_computed_blocks(request)  # the request trusts only the cache
                num_new = self._clamp(request.num_tokens - computed.num_tokens, computed.num_tokens, token_budget)
                if kv.allocate_slots(request, num_new, computed) is None:
                    break  # the pool is full: admit nobody behind it either
                self.waiting.pop()
                req_id = request.request_id
                block_ids = kv.get_block_ids(req_id)
                if request.status == RequestStatus.WAITING:
                    request.first_scheduled_step = step_id
                    request.first_scheduled_time = time.time()
                    request.num_cached_tokens = computed.num_tokens
                    new_reqs.append(
                        NewRequestData(
                            req_id,
                            list(request.prompt_token_ids),
                            request.sampling_params,
                            block_ids,
                            computed.num_tokens,
                        )
                    )
                else:  # back from preemption: the block table is replaced as a whole
                    cached_reqs.append(CachedRequestData(req_id, block_ids, computed.num_tokens, True))
                request.status = RequestStatus.RUNNING
                request.num_computed_tokens = computed.num_tokens
                self._add_running(request)
                num_scheduled_tokens[req_id] = num_new
                token_budget -= num_new
                self._advance(request, num_new)
            for request in reversed(skipped):
                self.waiting.add_front(request)

        finished_req_ids, self._finished_req_ids = self._finished_req_ids, []
        if token_budget < config.max_num_batched_tokens:
            self._num_steps += 1  # steps that run something; step_id counts every call
            self._num_scheduled_tokens += config.max_num_batched_tokens - token_budget
        output = SchedulerOutput(
            step_id=step_id,
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=config.max_num_batched_tokens - token_budget,
            scheduled_spec_decode_tokens=spec_decode_tokens,
            finished_req_ids=finished_req_ids,
            preempted_req_ids=preempted_req_ids,
        )
        self._schedule_s += time.perf_counter() - start
        return output

    def _num_new_tokens_running(self, request: Request, token_budget: int) -> int:
        """Tokens a RUNNING request has left: known + drafts + in-flight samples - computed."""
        config = self.config
        num_computed = request.num_computed_tokens
        placeholders = request.num_output_placeholders
        if placeholders and (
            # Tokens still in flight will finish it anyway: any more work would be thrown away.
            request.num_output_tokens + placeholders >= request.sampling_params.max_tokens
            or request.num_tokens + placeholders >= config.max_model_len
        ):
            return 0
        remaining = request.num_tokens + len(request.spec_token_ids) + placeholders - num_computed
        return self._clamp(remaining, num_computed, token_budget)

    def _clamp(self, num_new: int, num_computed: int, token_budget: int) -> int:
        """min(remaining, long-prefill threshold when on, budget, room left in max_model_len)."""
        threshold = self.config.long_prefill_token_threshold
        if 0 < threshold < num_new:
            num_new = threshold
        if num_new > token_budget:
            num_new = token_budget
        max_by_len = self.config.max_model_len - num_computed
        return num_new if num_new < max_by_len else max_by_len

    def _advance(self, request: Request, num_new: int) -> None:
        """Count a scheduled chunk as computed; a chunk reaching the end will sample a token."""
        num_computed = request.num_computed_tokens
        if num_computed < request.num_prompt_tokens:
            self._num_prompt_tokens += min(num_computed + num_new, request.num_prompt_tokens) - num_computed
        request.num_computed_tokens = num_computed + num_new
        if num_computed + num_new >= request.num_tokens + request.num_output_placeholders:
            request.num_output_placeholders += 1

    def _add_running(self, request: Request) -> None:
        if self.config.policy == "priority":
            insort(self.running, request, key=Request.sort_key)
        else:
            self.running.append(request)

    def _preempt(self, request: Request) -> None:
        """Recompute later: free the blocks, forget progress, wait at the front of the queue."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids.clear()
        self.waiting.add_front(request)
        self._num_preemptions += 1

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[RequestOutput]:
        """Apply one step's sampled tokens, run stop checks, finish requests that stopped.

        May come after a later ``schedule()``: requests gone since are skipped; a request
        preempted since still takes its token (it is part of its sequence).
        """
        start = time.perf_counter()
        step_id = scheduler_output.step_id
        drafts_by_req = scheduler_output.scheduled_spec_decode_tokens
        logprobs = model_runner_output.logprobs
        proposals = model_runner_output.spec_token_ids
        requests = self.requests
        outputs: list[RequestOutput] = []
        any_running_finished = False
        for i, (req_id, sampled) in enumerate(zip(model_runner_output.req_ids, model_runner_output.sampled_token_ids)):
            if not sampled:
                continue  # a partial prefill chunk samples nothing
            request = requests.get(req_id)
            if request is None or not 0 <= request.first_scheduled_step <= step_id:
                continue  # finished since, or the id now names a newer request
            request.num_output_placeholders -= 1
            drafts = drafts_by_req.get(req_id) if drafts_by_req else None
            if drafts and request.status == RequestStatus.RUNNING:
                # Rejected drafts had KV computed for nothing: step back over them.
                request.num_computed_tokens -= len(drafts) + 1 - len(sampled)
            num_accepted = 0
            finished_status = None
            for token_id in sampled:
                request.append_output_token_ids(token_id)
                num_accepted += 1
                finished_status = request.check_stop(token_id, self.config.max_model_len)
                if finished_status is not None:
                    break
            self._num_generation_tokens += num_accepted
            if finished_status is not None:
                any_running_finished |= request.status == RequestStatus.RUNNING
                self._finish(request, finished_status)
            elif proposals is not None and request.num_output_placeholders == 0:
                # Drafts extend the last known token; with a step still in flight they would not.
                request.spec_token_ids = list(proposals[i])
            elif request.spec_token_ids:
                request.spec_token_ids = []
            step_logprobs = logprobs[i] if logprobs is not None else None
            outputs.append(
                RequestOutput(
                    req_id,
                    sampled if num_accepted == len(sampled) else sampled[:num_accepted],
                    request.finish_reason if finished_status is not None else None,
                    request.num_cached_tokens,
                    [step_logprobs] if step_logprobs is not None else None,
                    request.stop_reason,
                    # The first output carries the queue time (arrival -> first scheduled).
                    request.first_scheduled_time - request.arrival_time
                    if request.num_output_tokens == num_accepted else None,
                )
            )
        if any_running_finished:
            self.running = [request for request in self.running if not request.is_finished]
        self._update_s += time.perf_counter() - start
        return outputs

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Mark finished, free its blocks, forget it; workers hear of it in the next step.

        The caller removes a RUNNING request from ``self.running`` (one filter per update).
        """
        if request.status != RequestStatus.RUNNING:
            self.waiting.remove(request)
        request.status = status
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        if request.first_scheduled_step >= 0:
            self._finished_req_ids.append(request.request_id)

    def get_stats(self) -> SchedulerStats:
        """A snapshot of what the scheduler owns (worker_* fields are the engine's)."""
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self._num_preemptions,
            num_steps=self._num_steps,
            num_prompt_tokens=self._num_prompt_tokens,
            num_generation_tokens=self._num_generation_tokens,
            schedule_s=self._schedule_s,
            update_s=self._update_s,
            num_scheduled_tokens=self._num_scheduled_tokens,
        )

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; requests in flight keep their blocks."""
        return self.kv_cache_manager.reset_prefix_cache()
