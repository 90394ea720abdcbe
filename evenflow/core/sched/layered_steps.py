"""The scheduler's layer-group phase: which prompt climbs the layers, its chunk, and its next group.

``Scheduler`` (scheduler.py) calls these from its phases: ``_layer_instead`` where a prompt chunk would
be cut (a running prompt or a waiting one), ``_schedule_layer_group`` after everybody else. What a
climb is and why: layered_prefill.py.
"""

from __future__ import annotations

from evenflow.protocol import CachedRequestData

from evenflow.core.request import Request, RequestStatus
from evenflow.core.sched.layered_prefill import LayeredPrefill, group_tokens, may_layer
from evenflow.core.sched.ledger import RequestLedger
from evenflow.core.sched.step_plan import StepPlan


class LayeredSteps(RequestLedger):
    """The prompt climbing the layers, as the scheduler's steps plan it."""

    _layered: LayeredPrefill | None = None  # the prompt climbing the layers, if any
    _yielded = False  # the last step was yielded to short prompts (the running prompt waited, or took what they left)
    _stopped_climb: Request | None = None  # the last prompt that stopped climbing (it goes on in token chunks)

    def _layer_instead(self, step: StepPlan, request: Request, num_computed: int) -> bool:
        """Whether ``request``'s prompt goes by layer groups rather than in token chunks: the adaptive
        budget would cut it, streams are decoding beside it, no prompt chunk or other layered prefill has
        this step's room, and one of its layers fits the step (BudgetController.prefers_layers)."""
        gate = step.gate
        if (not self.config.num_layers or request.num_tokens - num_computed <= 1 or self._layered is not None
                or gate.is_open or gate.whole_only or not gate.survey.decodes or gate.prefill_tokens
                or request is self._stopped_climb):
            return False
        num_new = self._layered_chunk(request, num_computed)
        controller = self.budget_controller
        return (controller is not None and num_new > gate.allowance_left and may_layer(self.config, request, num_new)
                and controller.prefers_layers(gate.survey, num_new, num_computed, self.config.num_layers))

    def _layered_chunk(self, request: Request, num_computed: int) -> int:
        """The tokens a layered prefill of ``request`` takes: all it has left, up to the token budget.
        Its groups are charged their share of them (``_schedule_layer_group``), so the climb needs no
        room kept for the streams that start beside it, and leaves no tail of tokens for a chunk after it
        (a step of its own before the first token)."""
        return self._clamp(request.num_tokens - num_computed, num_computed, self.config.max_num_batched_tokens)

    def _start_running_layered(self, step: StepPlan, request: Request) -> bool:
        """A running request mid-prompt (resumed, or chunked before streams were decoding) continues by
        layer groups when the free blocks hold its chunk (else False: a token chunk, which may preempt)."""
        num_new = self._layered_chunk(request, request.num_computed_tokens)
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
        step's token budget cannot hold a layer's share of its chunk (a group is charged its share: its
        tokens through a slice of the layers are that share of their work; in the slice's layers the step
        has more rows than the budget). Its last group counts the chunk as computed and samples."""
        layered = self._layered
        assert layered is not None and self.budget_controller is not None  # layered only under the controller
        request = layered.request
        gate = step.gate
        self._yielded = gate.prefill_tokens > 0  # short prompts took some of this step's room ...
        num_layers = self.config.num_layers
        most = num_layers - layered.next_layer  # the layers whose share the token budget holds
        while most > 0 and group_tokens(layered.num_tokens, layered.span(most, num_layers),
                                        num_layers) > step.token_budget:
            most -= 1
        if most == 0 or request.held:
            return
        controller = self.budget_controller
        if self._yielded:  # ... and a group rides beside them in what they left, or the climb waits a step
            layers = controller.layer_group_beside(gate.survey, gate.chunks, layered.num_tokens, layered.num_computed,
                                                   num_layers, most)
            if layers == 0:
                return
            self._yielded = False  # the climb did not wait: short prompts may come again next step
        else:
            layers = controller.layer_group(gate.survey, layered.num_tokens, layered.num_computed, num_layers,
                                            layered.next_layer, most)
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
        step.token_budget -= group_tokens(layered.num_tokens, (start, end), num_layers)
        gate.commit_layer_group(layered.num_tokens, layered.num_computed, (end - start) / num_layers)
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
