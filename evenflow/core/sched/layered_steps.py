"""The scheduler's layer-group phase: which prompt climbs the layers, its chunk, and its next group.

``Scheduler`` (scheduler.py) calls these from its phases: ``_layer_instead`` where a prompt chunk would
be cut (a running prompt or a waiting one), ``_schedule_layer_group`` after everybody else. What a
climb is and why: layered_prefill.py.
"""

from __future__ import annotations

from evenflow.protocol import CachedRequestData

from evenflow.core.request import Request, RequestStatus
from evenflow.core.sched.layered_prefill import CLIMB_SEATS, LayeredPrefill, may_layer
from evenflow.core.sched.ledger import RequestLedger
from evenflow.core.sched.step_plan import StepPlan


class LayeredSteps(RequestLedger):
    """The prompt climbing the layers, as the scheduler's steps plan it."""

    _layered: LayeredPrefill | None = None  # the prompt climbing the layers, if any
    _yielded = False  # the last step's prompt room went to short prompts ahead of a running prompt
    _stopped_climb: Request | None = None  # the last prompt that stopped climbing (it goes on in token chunks)

    def _layer_instead(self, step: StepPlan, request: Request, num_computed: int, token_budget: int) -> bool:
        """Whether ``request``'s prompt goes by layer groups rather than in token chunks: the adaptive
        budget would cut it, streams are decoding beside it, no prompt chunk or other layered prefill has
        this step's room, and one of its layers fits the step (BudgetController.prefers_layers)."""
        gate = step.gate
        if (not self.config.num_layers or request.num_tokens - num_computed <= 1 or self._layered is not None
                or gate.is_open or gate.whole_only or not gate.survey.decodes or gate.prefill_tokens
                or request is self._stopped_climb):
            return False
        num_new = self._layered_chunk(request, num_computed, token_budget)
        controller = self.budget_controller
        return (controller is not None and num_new > gate.allowance_left and may_layer(self.config, request, num_new)
                and controller.prefers_layers(gate.survey, num_new, num_computed, self.config.num_layers))

    def _layered_chunk(self, request: Request, num_computed: int, token_budget: int) -> int:
        """The tokens a layered prefill of ``request`` takes: all it has left, as far as the step holds
        beside a decode of every other running request, less ``CLIMB_SEATS`` (room for the streams short
        prompts may start while it climbs). Beside the others, not at its place in the running order: a
        request ahead of 40 streams under the priority policy, sized to the whole budget, never fitted."""
        others = len(self.running) - (request.status == RequestStatus.RUNNING)
        room = min(token_budget, self.config.max_num_batched_tokens - others) - CLIMB_SEATS
        return self._clamp(request.num_tokens - num_computed, num_computed, max(room, 2))

    def _start_running_layered(self, step: StepPlan, request: Request, token_budget: int) -> bool:
        """A running request mid-prompt (resumed, or chunked before streams were decoding) continues by
        layer groups when the free blocks hold its chunk (else False: a token chunk, which may preempt)."""
        num_new = self._layered_chunk(request, request.num_computed_tokens, token_budget)
        new_blocks = self.kv_cache_manager.allocate_slots(request, num_new, cache=False)
        if new_blocks is None:
            return False
        step.cached_reqs.append(CachedRequestData(
            req_id=request.request_id, new_block_ids=[block.block_id for block in new_blocks],
            num_computed_tokens=request.num_computed_tokens))
        self._layered = LayeredPrefill(request, num_new, request.num_computed_tokens)
        step.gate.close()
        return True

    def _schedule_layer_group(self, step: StepPlan) -> None:
        """The layered prefill's next group of layers, after everybody else: it waits a step while the
        step cannot hold its chunk. Its last group counts the chunk as computed and samples."""
        layered = self._layered
        assert layered is not None and self.budget_controller is not None  # layered only under the controller
        request = layered.request
        self._yielded = step.gate.prefill_tokens > 0  # short prompts took this step's room
        if self._yielded or layered.num_tokens > step.token_budget or request.held:
            return
        num_layers = self.config.num_layers
        layers = self.budget_controller.layer_group(step.gate.survey, layered.num_tokens, layered.num_computed,
                                                    num_layers, layered.next_layer)
        if layers == 0:  # a layer overruns the room: it goes on in token chunks from the next step, all layers
            self._layered, self._stopped_climb = None, request
            return
        start, end = layered.span(layers, num_layers)
        req_id = request.request_id
        if start > 0:  # the first group's step carried its blocks (admission, _start_running_layered)
            step.cached_reqs.append(CachedRequestData(req_id=req_id, new_block_ids=[],
                                                      num_computed_tokens=layered.num_computed))
        step.layer_spans[req_id] = (start, end)
        step.num_scheduled_tokens[req_id] = layered.num_tokens
        step.token_budget -= layered.num_tokens
        step.gate.commit_layer_group(layered.num_tokens, layered.num_computed, (end - start) / num_layers)
        if end < num_layers:
            layered.next_layer = end
            return
        self.kv_cache_manager.allocate_slots(request, layered.num_tokens)  # its blocks now serve prefix hits
        self._advance(request, layered.num_tokens)
        self._layered = None
        self._num_layered_prefills += 1

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """As the ledger's, and a prompt that finishes (an abort) while climbing stops climbing."""
        if self._layered is not None and request is self._layered.request:
            self._layered = None
        super()._finish(request, status)
