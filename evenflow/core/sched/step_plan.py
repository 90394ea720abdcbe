"""What one ``Scheduler.schedule()`` call builds: its phases fill a ``StepPlan`` in turn."""

from __future__ import annotations

from evenflow.protocol import CachedRequestData, NewRequestData

from evenflow.core.request import Request
from evenflow.core.sched.prefill_gate import PrefillGate


class StepPlan:
    """One step under construction: the budget left and what was scheduled so far.

    A slotted class, not a dataclass: one is built per step, and default factories cost more than
    the decodes of a small batch.
    """

    __slots__ = ("step_id", "token_budget", "gate", "num_running_at_start", "num_scheduled_tokens",
                 "num_draft_slots", "new_reqs", "cached_reqs", "preempted_req_ids", "structured", "layer_spans")

    def __init__(self, step_id: int, token_budget: int, gate: PrefillGate, num_running_at_start: int) -> None:
        self.step_id = step_id
        self.token_budget = token_budget  # tokens left in the step
        self.gate = gate  # this step's limits on prefill chunks
        self.num_running_at_start = num_running_at_start  # before any preemption: what draft slots look at
        self.num_scheduled_tokens: dict[str, int] = {}  # drafts included
        self.num_draft_slots: dict[str, int] = {}  # per request that has any
        self.new_reqs: list[NewRequestData] = []
        self.cached_reqs: list[CachedRequestData] = []
        self.preempted_req_ids: list[str] = []
        self.structured: list[Request] = []  # requests with a grammar that sample this step
        self.layer_spans: dict[str, tuple[int, int]] = {}  # a prompt prefilled by layer groups: its layers
