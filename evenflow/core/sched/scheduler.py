"""The scheduler: one token budget per step, shared by decodes and chunked prefills.

``schedule()`` is four phases over one ``StepPlan``: the RUNNING requests, in order, each with as many of its
remaining tokens as the budget allows (and its draft slots); then, only if nobody had to be preempted, the WAITING
requests, each only when the free blocks hold all its known tokens; then the next layer group of a prompt climbing
the layers (layered_steps.py), or in a step yielded to short prompts the chunk they made wait; then closing the step
into a ``SchedulerOutput``. When the KV cache cannot hold a chunk, the last RUNNING request (latest admitted under
``fcfs``, lowest priority under ``priority``) is preempted by recompute. Each phase has one hook method for what
LoRA (``_ready_to_admit``), KV offload (``_computed_blocks``, ``_close_step``) and a draft model
(``_reserve_draft_slots``) add.

``schedule()`` advances ``num_computed_tokens`` at once and counts a placeholder for every token the step will
sample, so the next step can be scheduled before this one's tokens are known (the workers fill those inputs from
their own last sample). The rest of the scheduler, its state, the requests coming in and ``update_from_output()`` (a
step's tokens and the stop checks, possibly after a later step was scheduled), is ``RequestLedger`` in
evenflow/core/sched/ledger.py.

Every prefill chunk passes the step's ``PrefillGate``: open by default (the token budget alone limits it); with
``--target-itl-ms`` the ``BudgetController`` chooses how much prompt work rides along with the decodes (a prompt it
would cut goes by layer groups instead: layered_prefill.py; a short prompt behind a climb goes whole in the next
step, beside the climb's group where its room is left, and behind a chunked prompt likewise, its chunk beside them
in what is left), and ``--max-num-partial-prefills`` bounds the prompts mid-prefill.
"""

from __future__ import annotations

import time
from itertools import islice

from evenflow.protocol import CachedRequestData, NewRequestData, SchedulerOutput

from evenflow.core.kv.block_pool import KVBlock
from evenflow.core.kv.manager import ComputedBlocks
from evenflow.core.sched.budget_controller import PREFILL_FLOOR_TOKENS
from evenflow.core.sched.layered_prefill import LayeredPrefill
from evenflow.core.sched.layered_steps import LayeredSteps
from evenflow.core.sched.prefill_gate import PrefillGate
from evenflow.core.sched.step_plan import StepPlan
from evenflow.core.request import Request, RequestStatus
from evenflow.core.sched.draft_slots import num_draft_slots


SHORT_PROMPT_SCAN = 16  # waiting prompts a step looks through for a short one (it runs every step)


class Scheduler(LayeredSteps):
    """Decides, step by step, which requests run and how many of their tokens."""

    def schedule(self) -> SchedulerOutput:
        """Plan the next step: which requests run, how many tokens each, with which blocks."""
        start = time.perf_counter()
        step = self._open_step()
        self._schedule_running(step)
        if not step.preempted_req_ids:  # admitted requests would only preempt back
            self._schedule_waiting(step)
        if self._layered is not None:
            self._schedule_layer_group(step)
        elif step.gate.whole_only and not step.preempted_req_ids:
            self._schedule_chunk_beside(step)
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
        if self._layered is not None and not gate.is_open:  # the prompt climbing the layers has the room ...
            # ... but for short prompts, unless the climb waited for the last ones (layered_prefill.py)
            if self._yielded or self.waiting and not self._may_pass(self.waiting.peek(), self._layered.request):
                gate.close()
            else:
                gate.whole_prompts_only(config.max_num_seqs - len(self.running))
        elif not gate.is_open:
            # Likewise a prompt in token chunks: a short prompt waiting behind it goes whole in one step
            # (its chunk, not whole, is refused), every other step at most.
            self._yielded = not self._yielded and self._short_prompt_waits(gate)
            if self._yielded:
                gate.whole_prompts_only(config.max_num_seqs - len(self.running))
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
            if self._layered is not None and request is self._layered.request:
                index += 1  # its next layer group comes after the others (_schedule_layer_group)
                continue
            num_new = 0 if request.held else self._num_new_tokens_running(request, token_budget)
            if gated and num_new > 0:
                if (self._layer_instead(step, request, request.num_computed_tokens)
                        and self._start_running_layered(step, request)):
                    index += 1
                    continue
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
                if more_blocks:
                    new_blocks = new_blocks + more_blocks
            token_budget -= num_new + num_slots
            self._place_running(step, request, num_new, new_blocks, num_slots)
            index += 1
        step.token_budget = token_budget

    def _place_running(self, step: StepPlan, request: Request, num_new: int, new_blocks: list[KVBlock],
                       num_slots: int = 0) -> None:
        """Put a running request's allocated chunk (and its draft slots) into the step."""
        step.cached_reqs.append(CachedRequestData(
            req_id=request.request_id, new_block_ids=[block.block_id for block in new_blocks],
            num_computed_tokens=request.num_computed_tokens))
        step.num_scheduled_tokens[request.request_id] = num_new + num_slots
        self._advance(request, num_new + num_slots, num_slots)
        if request.grammar is not None and request.num_output_placeholders:
            step.structured.append(request)

    def _schedule_chunk_beside(self, step: StepPlan) -> None:
        """Phase 3 of a step yielded to short prompts: the chunk phase 1 refused runs in the allowance they left
        (``PREFILL_FLOOR_TOKENS`` at least), on free blocks only (nobody admitted is preempted back), and saves the
        decodes a step of their own. Short prompts still get every other step at most: given the next one too,
        they took more of the long prompt's room than they gave back (virtual clock, tiny model: TTFT 1.1x)."""
        gate = step.gate
        gate.reopen_chunks()
        request = self._prompt_in_chunks()  # the one that waited
        if request is None or request.held or request.request_id in step.num_scheduled_tokens:
            return
        num_computed = request.num_computed_tokens
        num_new = gate.limit(request, num_computed, self._num_new_tokens_running(request, step.token_budget))
        if num_new < PREFILL_FLOOR_TOKENS:
            return
        new_blocks = self.kv_cache_manager.allocate_slots(request, num_new)
        if new_blocks is not None:
            gate.commit(request, num_computed, num_new)
            step.token_budget -= num_new
            self._place_running(step, request, num_new, new_blocks)

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
            if self._layer_instead(step, request, num_computed):
                num_layered = self._layered_chunk(request, num_computed)
                if (self.running and not self._pool_holds_prompt(request, computed)
                        or kv.allocate_slots(request, num_layered, computed, cache=False) is None):
                    break  # as below: admit nobody behind it
                waiting.pop()
                self._admit(step, request, num_computed)
                self._layered = LayeredPrefill(request, num_layered, num_computed)
                gate.close()
                break  # its first group takes the step's prompt room (_schedule_layer_group)
            num_new = self._clamp(request.num_tokens - num_computed, num_computed, token_budget)
            num_new = gate.limit(request, num_computed, num_new)
            if num_new <= 0:
                if gate.lets_others_pass(request, num_computed):
                    skipped.append(waiting.pop())  # shorter prompts behind it may go
                    continue
                break
            if self.running and not self._pool_holds_prompt(request, computed):
                break  # it would take the running requests' blocks chunk by chunk: admit nobody behind it
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

    def _short_prompt_waits(self, gate: PrefillGate) -> bool:
        """Whether a prompt runs in token chunks while one of the first ``SHORT_PROMPT_SCAN`` waiting
        prompts would go whole ahead of its next chunk: admissible now, prefilled whole within the step's
        allowance (``PrefillGate.fits_whole``), its blocks free, and allowed to pass it (``_may_pass``).
        (The chunk took the allowance and a short prompt waited for every chunk: beside the small model's
        chunked 2048-token prompts the streams' new prompts waited ~1 s at p99.) Not only the queue's
        head: a long prompt waiting there for the chunked one lets the short ones behind it pass. Under
        the partial-prefill bounds short prompts go beside it already."""
        if (not gate.survey.prefills or gate.bounded or not self.waiting
                or len(self.running) >= self.config.max_num_seqs):
            return False
        chunked = self._prompt_in_chunks()
        assert chunked is not None  # the survey counted it
        return any(self._admissible(request) and gate.fits_whole(request, self.config.max_num_batched_tokens)
                   and self._pool_holds_prompt(request) and self._may_pass(request, chunked)
                   for request in islice(self.waiting, SHORT_PROMPT_SCAN))

    def _prompt_in_chunks(self) -> Request | None:
        """The first running request with more than one known token left: the prompt short ones pass."""
        return next((r for r in self.running if r.num_tokens - r.num_computed_tokens > 1), None)

    def _may_pass(self, waiting: Request, running: Request) -> bool:
        """Whether a ``waiting`` prompt may take a step from a ``running`` one's prefill: always, but
        under the ``priority`` policy only one of its rank or higher."""
        return self.config.policy != "priority" or waiting.priority <= running.priority

    def _ready_to_admit(self, request: Request) -> bool:
        """Whether a waiting request may be admitted now; False: it keeps its place (or it has
        finished: its grammar failed to compile)."""
        if request.status == RequestStatus.WAITING_FOR_FSM and not request.held and not self._grammar_ready(request):
            return False
        return self._admissible(request)

    def _admissible(self, request: Request) -> bool:
        """``_ready_to_admit`` without compiling: False while its grammar compiles."""
        if request.held or request.status == RequestStatus.WAITING_FOR_FSM:
            return False
        if request.num_output_placeholders:
            return False  # a token of an in-flight step is owed to it
        # Its adapter must be loaded, and may not be one more than max_loras among the running.
        return self.lora_slots is None or self.lora_slots.admits(request, self.running)

    def _pool_holds_prompt(self, request: Request, computed: ComputedBlocks | None = None) -> bool:
        """Whether the free blocks hold all of a waiting request's known tokens (past its cached prefix,
        when ``computed`` is given), not only its first
        chunk: admitted on one chunk's blocks, a prompt took the rest from the running requests as
        its chunks came, and they were preempted to recompute (Poisson load, real model, KV full:
        21-26 preemptions with chunks of ~200 tokens against 5-6 with 2048-token steps, which
        admit a prompt only on all its blocks)."""
        needed = -(-request.num_tokens // self.config.block_size) - (len(computed.blocks) if computed else 0)
        return needed <= self.kv_cache_manager.num_free_blocks

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
        total = sum(step.num_scheduled_tokens.values())  # rows: a layer group's whole chunk
        if total:
            self._num_steps += 1  # steps that run something; step_id counts every call
            # the budget's tokens: a layer group's share of its chunk, the work it does
            self._num_scheduled_tokens += self.config.max_num_batched_tokens - step.token_budget
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
            layer_spans=step.layer_spans,
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

    def _preempt(self, request: Request) -> None:
        """Recompute later: free the blocks, forget progress, wait at the front of the queue."""
        if self._layered is not None and request is self._layered.request:
            self._layered = None  # its layers so far are lost with its blocks
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_proposed_drafts = 0
        self.waiting.add_front(request)
        self._num_preemptions += 1

