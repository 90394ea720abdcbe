"""The scheduler's books: its state, requests coming in, a step's results coming back, requests leaving.

``Scheduler`` (evenflow/core/sched/scheduler.py) is this class plus the step itself, ``schedule()``.
Here: ``add_request`` / ``abort_requests`` / ``hold_requests`` from the engine's clients,
``update_from_output()`` applying one step's sampled tokens (possibly after a later step was
scheduled) with the stop checks, ``_finish`` freeing a finished request, and ``get_stats()``; and the
per-request rules a step applies: the tokens a request has left (``_num_new_tokens_running``,
``_clamp``), a grammar's readiness, a chunk counted as computed (``_advance``).
"""

from __future__ import annotations

import time
from bisect import insort
from collections.abc import Iterable

from evenflow.protocol import (
    ERR_INVALID_REQUEST,
    Error,
    ModelRunnerOutput,
    RequestOutput,
    SchedulerCounts,
    SchedulerOutput,
    SchedulerStats,
)

from evenflow.core.sched.budget_controller import BudgetController
from evenflow.core.sched.config import SchedulerConfig
from evenflow.core.kv.manager import KVCacheManager
from evenflow.core.request import FCFSQueue, PriorityQueue, Request, RequestStatus, WaitingQueue
from evenflow.core.sched.draft_slots import SpecDecodeCounters
from evenflow.core.sched.lora_slots import LoRASlots
from evenflow.core.sched.structured_output import StructuredOutputManager


class RequestLedger:
    """Every unfinished request, the queues, the counters; how requests enter and leave."""

    def __init__(self, config: SchedulerConfig, structured_output: StructuredOutputManager | None = None) -> None:
        config.validate()
        self.config = config
        self.structured_output = structured_output  # None: requests with a grammar are refused
        self.kv_cache_manager = KVCacheManager(config.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.waiting: WaitingQueue = PriorityQueue() if config.policy == "priority" else FCFSQueue()
        # Kept in policy order, so the request to preempt is always the last one.
        self.running: list[Request] = []
        self._finished_req_ids: list[str] = []  # for the next SchedulerOutput
        self._long_threshold = config.effective_long_prefill_threshold  # read per request on the hot path
        self.budget_controller = BudgetController.for_config(config)  # None without --target-itl-ms
        self._next_step_id = 0
        self._num_steps = 0
        self._num_preemptions = 0
        self._num_layered_prefills = 0  # prompt chunks prefilled by layer groups (core/sched/layered_prefill.py)
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._num_scheduled_tokens = 0  # every step's scheduled tokens, recomputation included (a layer group: its share)
        self._schedule_s = 0.0
        self._update_s = 0.0
        self._spec_counters = SpecDecodeCounters()
        self._grammar_failures: list[Error] = []  # for take_grammar_failures (LoRA load failures too)
        self.lora_slots = LoRASlots(config.max_loras) if config.max_loras else None  # None: LoRA off

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
        if request.lora is not None and self.lora_slots is None:
            raise ValueError("this engine-core does not serve LoRA adapters (start it with --enable-lora)")
        if request.use_structured_output:
            if self.structured_output is None:
                raise ValueError("this engine-core does not serve structured output")
            self.structured_output.submit(request)  # ValueError when it cannot even start
            request.status = RequestStatus.WAITING_FOR_FSM
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

    def hold_requests(self, request_ids: Iterable[str], hold: bool) -> None:
        """Backpressure: a held request is not scheduled (keeps its blocks) until released."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                request.held = hold

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[RequestOutput]:
        """Apply one step's sampled tokens, run stop checks, finish requests that stopped.

        May come after a later ``schedule()``: requests gone since are skipped; a request
        preempted since still takes its token (it is part of its sequence).
        """
        start = time.perf_counter()
        step_id = scheduler_output.step_id
        slots_by_req = scheduler_output.num_draft_slots
        logprobs = model_runner_output.logprobs
        proposals = model_runner_output.num_proposed_drafts
        num_verified = model_runner_output.num_draft_tokens
        requests = self.requests
        outputs: list[RequestOutput] = []
        any_running_finished = False
        if self.lora_slots is not None:
            self.lora_slots.observe(model_runner_output)
            if self.lora_slots.failed:
                self._fail_lora_requests(self.lora_slots)
        if model_runner_output.prompt_logprobs:
            for req_id, rows in model_runner_output.prompt_logprobs.items():
                request = requests.get(req_id)
                if request is not None and 0 <= request.first_scheduled_step <= step_id:
                    request.add_prompt_logprobs(rows)
        for i, (req_id, sampled) in enumerate(zip(model_runner_output.req_ids, model_runner_output.sampled_token_ids)):
            if not sampled:
                continue  # a partial prefill chunk samples nothing
            request = requests.get(req_id)
            if request is None or not 0 <= request.first_scheduled_step <= step_id:
                continue  # finished since, or the id now names a newer request
            num_slots = slots_by_req.get(req_id, 0) if slots_by_req else 0
            request.num_output_placeholders -= 1 + num_slots
            if num_slots and request.status == RequestStatus.RUNNING:
                # Step back over rejected drafts and unfilled slots; their KV is overwritten later.
                request.num_computed_tokens -= num_slots + 1 - len(sampled)
            if num_verified and num_verified[i]:
                self._spec_counters.record(num_verified[i], len(sampled) - 1)
            num_accepted = 0
            finished_status = None
            for token_id in sampled:
                request.append_output_token_ids(token_id)
                num_accepted += 1
                finished_status = request.check_stop(token_id, self.config.max_model_len)
                if finished_status is not None:
                    break
            if request.grammar is not None and self.structured_output is not None:
                self.structured_output.accept(request, sampled[:num_accepted])
            self._num_generation_tokens += num_accepted
            if finished_status is not None:
                any_running_finished |= request.status == RequestStatus.RUNNING
                self._finish(request, finished_status)
            elif proposals is not None and request.num_output_placeholders == 0 and not request.use_structured_output:
                # Drafts extend the last known token; with a step still in flight they would not.
                request.num_proposed_drafts = proposals[i]
            else:
                request.num_proposed_drafts = 0
            token_logprobs = logprobs[i] if logprobs is not None else None
            outputs.append(
                RequestOutput(
                    req_id,
                    sampled if num_accepted == len(sampled) else sampled[:num_accepted],
                    request.finish_reason if finished_status is not None else None,
                    request.num_cached_tokens,
                    token_logprobs[:num_accepted] if token_logprobs is not None else None,
                    request.stop_reason,
                    # The first output carries the queue time (arrival -> first scheduled).
                    request.first_scheduled_time - request.arrival_time
                    if request.num_output_tokens == num_accepted else None,
                    request.take_prompt_logprobs() if request.prompt_logprobs is not None else None,
                )
            )
        if any_running_finished:
            self.running = [request for request in self.running if not request.is_finished]
        if self.budget_controller is not None:
            self.budget_controller.observe(scheduler_output, model_runner_output)
        self._update_s += time.perf_counter() - start
        return outputs

    def _fail_lora_requests(self, slots: LoRASlots) -> None:
        """Finish the waiting requests whose adapter failed to load; their clients hear why."""
        failed, slots.failed = slots.failed, {}
        for request in list(self.requests.values()):  # _finish removes from requests
            lora = request.lora
            if lora is not None and lora.identity in failed and request.status != RequestStatus.RUNNING:
                self._finish(request, RequestStatus.FINISHED_ERROR)
                self._grammar_failures.append(Error(
                    ERR_INVALID_REQUEST, f"LoRA adapter {lora.name!r} failed to load: {failed[lora.identity]}",
                    request.request_id))

    def take_grammar_failures(self) -> list[Error]:
        """``invalid_request`` errors (engine request ids) of the grammars that failed to compile."""
        failures, self._grammar_failures = self._grammar_failures, []
        return failures

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

    def _num_new_tokens_running(self, request: Request, token_budget: int) -> int:
        """Tokens a RUNNING request has left: known + drafts + in-flight samples - computed."""
        config = self.config
        num_computed = request.num_computed_tokens
        placeholders = request.num_output_placeholders
        if placeholders and request.grammar is not None:
            return 0  # its next mask depends on the token still in flight: wait for it
        if placeholders and (
            # Tokens still in flight will finish it anyway: any more work would be thrown away.
            request.num_output_tokens + placeholders >= request.sampling_params.max_tokens
            or request.num_tokens + placeholders >= config.max_model_len
        ):
            return 0
        remaining = request.num_tokens + placeholders - num_computed
        return self._clamp(remaining, num_computed, token_budget)

    def _clamp(self, num_new: int, num_computed: int, token_budget: int) -> int:
        """min(remaining, long-prefill threshold when on, budget, room left in max_model_len)."""
        threshold = self._long_threshold
        if 0 < threshold < num_new:
            num_new = threshold
        if num_new > token_budget:
            num_new = token_budget
        max_by_len = self.config.max_model_len - num_computed
        return num_new if num_new < max_by_len else max_by_len

    def _grammar_ready(self, request: Request) -> bool:
        """Whether a WAITING_FOR_FSM request's grammar compiled (it becomes WAITING); a failed
        compile finishes it (its client hears why: ``take_grammar_failures``)."""
        grammars = self.structured_output
        assert grammars is not None  # add_request admits grammars only with a manager
        problem = grammars.resolve(request)
        if problem:
            self._finish(request, RequestStatus.FINISHED_ERROR)
            self._grammar_failures.append(Error(ERR_INVALID_REQUEST, problem, request.request_id))
        elif problem == "":
            request.status = RequestStatus.WAITING
        return problem == ""

    def _advance(self, request: Request, num_new: int, num_slots: int = 0) -> None:
        """Count a scheduled chunk as computed; a chunk reaching the end will sample tokens:
        up to ``1 + num_slots`` of them, all counted in flight until the step's results arrive."""
        num_computed = request.num_computed_tokens
        if num_computed < request.num_prompt_tokens:
            self._num_prompt_tokens += min(num_computed + num_new, request.num_prompt_tokens) - num_computed
        request.num_computed_tokens = num_computed + num_new
        if num_computed + num_new - num_slots >= request.num_tokens + request.num_output_placeholders:
            request.num_output_placeholders += 1 + num_slots

    def _add_running(self, request: Request) -> None:
        if self.config.policy == "priority":
            insort(self.running, request, key=Request.sort_key)
        else:
            self.running.append(request)

    def get_stats(self) -> SchedulerStats:
        """A snapshot of what the scheduler owns (worker_* fields are the engine's)."""
        stats = SchedulerStats(
            scheduler=SchedulerCounts(
                num_running=len(self.running),
                num_waiting=len(self.waiting),
                num_preemptions=self._num_preemptions,
                num_steps=self._num_steps,
                num_prompt_tokens=self._num_prompt_tokens,
                num_generation_tokens=self._num_generation_tokens,
                num_scheduled_tokens=self._num_scheduled_tokens,
                schedule_s=self._schedule_s,
                update_s=self._update_s,
                num_layered_prefills=self._num_layered_prefills,
            ),
            kv_cache=self.kv_cache_manager.stats(),
            spec_decode=self._spec_counters.stats(),
        )
        if self.structured_output is not None:
            stats.grammar = self.structured_output.stats.snapshot()
        return stats if self.budget_controller is None else self.budget_controller.fill_stats(stats)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; requests in flight keep their blocks."""
        return self.kv_cache_manager.reset_prefix_cache()
