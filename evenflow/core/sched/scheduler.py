"""The scheduler: one token budget per step, shared by decodes and chunked prefills.

``schedule()`` is three phases over one ``StepPlan``: the RUNNING requests, in order, each with as
many of its remaining tokens as the budget allows (and its draft slots); then, only if nobody had to
be preempted, the WAITING requests; then closing the step into a ``SchedulerOutput``. When the KV
cache cannot hold a chunk, the last RUNNING request (latest admitted under ``fcfs``, lowest
priority under ``priority``) is preempted by recompute. Each phase has one hook method for what
LoRA (``_ready_to_admit``), KV offload (``_computed_blocks``, ``_close_step``) and a draft model
(``_reserve_draft_slots``) add.

``schedule()`` advances ``num_computed_tokens`` at once and counts a placeholder for every token
the step will sample, so the next step can be scheduled before this one's tokens are known (the
workers fill those inputs from their own last sample). ``update_from_output()`` applies a step's
tokens, possibly after a later step was scheduled, and runs the stop checks.

Every prefill chunk passes the step's ``PrefillGate``: open by default (the token budget alone
limits it); with ``--target-itl-ms`` the ``BudgetController`` chooses how much prompt work rides
along with the decodes, and ``--max-num-partial-prefills`` bounds the prompts mid-prefill.
"""

from __future__ import annotations

import time
from bisect import insort
from collections.abc import Iterable

from evenflow.protocol import (
    ERR_INVALID_REQUEST,
    CachedRequestData,
    Error,
    ModelRunnerOutput,
    NewRequestData,
    RequestOutput,
    SchedulerOutput,
    SchedulerStats,
)

from evenflow.core.sched.budget_controller import BudgetController
from evenflow.core.sched.config import SchedulerConfig
from evenflow.core.kv.block_pool import KVBlock
from evenflow.core.kv.manager import ComputedBlocks, KVCacheManager
from evenflow.core.sched.prefill_gate import PrefillGate
from evenflow.core.sched.step_plan import StepPlan
from evenflow.core.request import FCFSQueue, PriorityQueue, Request, RequestStatus, WaitingQueue
from evenflow.core.sched.draft_slots import SpecDecodeCounters, num_draft_slots
from evenflow.core.sched.lora_slots import LoRASlots
from evenflow.core.sched.structured_output import StructuredOutputManager


class Scheduler:
    """Decides, step by step, which requests run and how many of their tokens."""

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
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._num_scheduled_tokens = 0  # every step's scheduled tokens, recomputation included
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

    def schedule(self) -> SchedulerOutput:
        """Plan the next step: which requests run, how many tokens each, with which blocks."""
        start = time.perf_counter()
        step = self._open_step()
        self._schedule_running(step)
        if not step.preempted_req_ids:  # admitted requests would only preempt back
            self._schedule_waiting(step)
        output = self._close_step(step)
        self._schedule_s += time.perf_counter() - start
        return output

    def _open_step(self) -> StepPlan:
        """A fresh plan: the whole token budget, and this step's prefill gate (how much prompt
        work rides along with the decodes; an open gate when only the token budget limits it)."""
        config = self.config
        step_id = self._next_step_id
        self._next_step_id += 1
        controller = self.budget_controller
        gate = PrefillGate.for_step(config, self._long_threshold, self.running, len(self.waiting),
                                    None if controller is None else controller.prefill_allowance)
        return StepPlan(step_id=step_id, token_budget=config.max_num_batched_tokens, gate=gate,
                        num_running_at_start=len(self.running))

    def _schedule_running(self, step: StepPlan) -> None:
        """Phase 1: RUNNING requests, in order, each as many of its tokens as the budget allows.

        When the KV cache is full the last RUNNING request is preempted; a victim is always behind
        the current index, so nothing scheduled earlier in this step is ever taken back.
        """
        kv = self.kv_cache_manager
        gate = step.gate
        gated = not gate.is_open  # decodes dominate this loop: an open gate is not even called
        speculative = self.config.speculative_config is not None
        running = self.running
        token_budget = step.token_budget
        index = 0
        while index < len(running) and token_budget > 0:
            request = running[index]
            num_new = 0 if request.held else self._num_new_tokens_running(request, token_budget)
            if gated and num_new > 0:
                num_new = gate.limit(request, request.num_computed_tokens, num_new)
            if num_new <= 0:
                index += 1
                continue
            new_blocks = kv.allocate_slots(request, num_new)
            while new_blocks is None:
                victim = running.pop()
                self._preempt(victim)
                step.preempted_req_ids.append(victim.request_id)
                if victim is request:
                    break
                new_blocks = kv.allocate_slots(request, num_new)
            if new_blocks is None:
                break  # the request itself was the last one running
            if gated:
                gate.commit(request, request.num_computed_tokens, num_new)
            num_slots = 0
            if speculative:
                num_slots, more_blocks = self._reserve_draft_slots(step, request, num_new, token_budget - num_new)
                num_new += num_slots
                if more_blocks:
                    new_blocks = new_blocks + more_blocks
            step.cached_reqs.append(CachedRequestData(
                req_id=request.request_id,
                new_block_ids=[block.block_id for block in new_blocks] if new_blocks else [],
                num_computed_tokens=request.num_computed_tokens))
            step.num_scheduled_tokens[request.request_id] = num_new
            token_budget -= num_new
            self._advance(request, num_new, num_slots)
            if request.grammar is not None and request.num_output_placeholders:
                step.structured.append(request)
            index += 1
        step.token_budget = token_budget

    def _reserve_draft_slots(self, step: StepPlan, request: Request, num_new: int,
                             budget_left: int) -> tuple[int, list[KVBlock]]:
        """Phase 1's draft slots for a running request just given ``num_new`` tokens: how many,
        and the blocks they took. A draft never preempts anybody: with no room the request runs
        without. Hook: a draft model that needs its own KV reserves it here."""
        num_slots = num_draft_slots(self.config.speculative_config, request, num_new, budget_left,
                                    self.config.max_model_len, step.num_running_at_start)
        if not num_slots:
            return 0, []
        more_blocks = self.kv_cache_manager.allocate_slots(request, num_new + num_slots)
        if more_blocks is None:
            return 0, []
        step.num_draft_slots[request.request_id] = num_slots  # the worker fills them (spec_decode.py)
        return num_slots, more_blocks

    def _schedule_waiting(self, step: StepPlan) -> None:
        """Phase 2: WAITING requests in queue order, while the budget, the seats and the blocks last."""
        kv = self.kv_cache_manager
        gate = step.gate
        waiting = self.waiting
        max_num_seqs = self.config.max_num_seqs
        token_budget = step.token_budget
        skipped: list[Request] = []  # keep their places, serve the others
        while waiting and token_budget > 0 and len(self.running) < max_num_seqs:
            request = waiting.peek()
            if not self._ready_to_admit(request):
                if not request.is_finished:
                    skipped.append(waiting.pop())
                continue
            computed = self._computed_blocks(request)
            num_computed = computed.num_tokens
            num_new = self._clamp(request.num_tokens - num_computed, num_computed, token_budget)
            num_new = gate.limit(request, num_computed, num_new)
            if num_new <= 0:
                if gate.long_slot_full(request, num_computed):
                    skipped.append(waiting.pop())  # shorter prompts behind it may go
                    continue
                break
            if kv.allocate_slots(request, num_new, computed) is None:
                break  # the pool is full: admit nobody behind it either
            gate.commit(request, num_computed, num_new)
            waiting.pop()
            self._admit(step, request, num_computed)
            step.num_scheduled_tokens[request.request_id] = num_new
            token_budget -= num_new
            self._advance(request, num_new)
            if request.grammar is not None and request.num_output_placeholders:
                step.structured.append(request)
        for request in reversed(skipped):
            waiting.add_front(request)
        step.token_budget = token_budget

    def _ready_to_admit(self, request: Request) -> bool:
        """Whether a waiting request may be admitted now; False: it keeps its place (or it has
        finished: its grammar failed to compile)."""
        if request.held or (request.status == RequestStatus.WAITING_FOR_FSM and not self._grammar_ready(request)):
            return False
        if request.num_output_placeholders:
            return False  # a token of an in-flight step is owed to it
        # Its adapter must be loaded, and may not be one more than max_loras among the running.
        return self.lora_slots is None or self.lora_slots.admits(request, self.running)

    def _computed_blocks(self, request: Request) -> ComputedBlocks:
        """The prefix a waiting request need not compute (it trusts only the cache).
        Hook: a KV offload tier adds the blocks it can load back here."""
        return self.kv_cache_manager.get_computed_blocks(request)

    def _admit(self, step: StepPlan, request: Request, num_computed: int) -> None:
        """Make an allocated waiting request RUNNING; the workers hear of it as new, or, back from
        preemption, as a cached request whose block table is replaced as a whole."""
        req_id = request.request_id
        block_ids = self.kv_cache_manager.get_block_ids(req_id)
        if request.status == RequestStatus.WAITING:
            request.first_scheduled_step = step.step_id
            request.first_scheduled_time = time.time()
            request.num_cached_tokens = num_computed
            step.new_reqs.append(NewRequestData(
                req_id=req_id, prompt_token_ids=list(request.prompt_token_ids),
                sampling_params=request.sampling_params, block_ids=block_ids, num_computed_tokens=num_computed,
                lora=request.lora))
        else:
            step.cached_reqs.append(CachedRequestData(
                req_id=req_id, new_block_ids=block_ids, num_computed_tokens=num_computed,
                resumed_from_preemption=True))
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_computed
        self._add_running(request)

    def _close_step(self, step: StepPlan) -> SchedulerOutput:
        """Phase 3: the SchedulerOutput, with the step's extras (the grammar masks of the requests
        that sample; the controller records what it allowed; the workers' LoRA load orders).
        Hook: a KV offload's load/store orders ride along here."""
        max_tokens = self.config.max_num_batched_tokens
        total = max_tokens - step.token_budget
        if total:
            self._num_steps += 1  # steps that run something; step_id counts every call
            self._num_scheduled_tokens += total
        finished_req_ids, self._finished_req_ids = self._finished_req_ids, []
        output = SchedulerOutput(
            step_id=step.step_id,
            scheduled_new_reqs=step.new_reqs,
            scheduled_cached_reqs=step.cached_reqs,
            num_scheduled_tokens=step.num_scheduled_tokens,
            total_num_scheduled_tokens=total,
            num_draft_slots=step.num_draft_slots,
            finished_req_ids=finished_req_ids,
            preempted_req_ids=step.preempted_req_ids,
        )
        if self.budget_controller is not None:
            self.budget_controller.record(output, step.gate)
        if self.lora_slots is not None:
            output.lora_prefetch, output.lora_unloaded = self.lora_slots.take_orders()
        if step.structured:
            grammars = self.structured_output
            assert grammars is not None  # add_request refuses grammars without one
            output.structured_output_req_ids = [request.request_id for request in step.structured]
            output.grammar_bitmask = grammars.fill_bitmask(step.structured)
        return output

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

    def _fail_lora_requests(self) -> None:
        """Finish the waiting requests whose adapter failed to load; their clients hear why."""
        failed, self.lora_slots.failed = self.lora_slots.failed, {}  # type: ignore[union-attr]
        for request in [r for r in self.requests.values() if r.lora is not None and r.lora.identity in failed]:
            if request.status != RequestStatus.RUNNING:
                self._finish(request, RequestStatus.FINISHED_ERROR)
                self._grammar_failures.append(Error(
                    ERR_INVALID_REQUEST, f"LoRA adapter {request.lora.name!r} failed to load: "  # type: ignore[union-attr]
                    f"{failed[request.lora.identity]}", request.request_id))  # type: ignore[union-attr]

    def take_grammar_failures(self) -> list[Error]:
        """``invalid_request`` errors (engine request ids) of the grammars that failed to compile."""
        failures, self._grammar_failures = self._grammar_failures, []
        return failures

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

    def _preempt(self, request: Request) -> None:
        """Recompute later: free the blocks, forget progress, wait at the front of the queue."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_proposed_drafts = 0
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
                self._fail_lora_requests()
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
        stats = self._spec_counters.fill(SchedulerStats(
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
            **(self.structured_output.stats.as_fields() if self.structured_output else {}),
        ))
        return stats if self.budget_controller is None else self.budget_controller.fill_stats(stats)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; requests in flight keep their blocks."""
        return self.kv_cache_manager.reset_prefix_cache()
