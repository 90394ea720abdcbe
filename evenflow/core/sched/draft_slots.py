"""Speculative decoding in the engine-core: how many draft slots a request gets, and the counters.

The drafts themselves live in the workers (the n-gram proposer runs where the tokens are, right
after sampling). The scheduler only reserves slots: a decoding request with ``k`` slots costs
``1 + k`` tokens of the step's budget, and when the results come back ``num_computed_tokens``
rolls back over the rejected ones. With overlap on, step N+1 is scheduled before step N's tokens
and drafts are known, so the scheduler reserves ``num_speculative_tokens`` slots blindly and the
worker fills as many as it has drafts for; with overlap off it knows the proposals and reserves
exactly their number.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from evenflow.protocol import SpecDecodingStats, SpeculativeConfig

from evenflow.core.request import Request


def num_draft_slots(
    spec: SpeculativeConfig | None, request: Request, num_new: int, budget_left: int, max_model_len: int,
    num_running: int,
) -> int:
    """Draft slots for a running request scheduled ``num_new`` known (or in-flight) tokens."""
    if spec is None or budget_left <= 0 or request.use_structured_output:
        return 0  # a grammar's matcher would have to check drafts: speculation is off for it
    if spec.disable_by_batch_size is not None and num_running >= spec.disable_by_batch_size:
        return 0  # under load the forward is compute-bound: drafts would only add work
    placeholders = request.num_output_placeholders
    end = request.num_computed_tokens + num_new
    if end != request.num_tokens + placeholders:
        return 0  # a prefill chunk that does not sample
    # With a step in flight its drafts are unknown: reserve K, the worker fills what it has.
    wanted = spec.num_speculative_tokens if placeholders else request.num_proposed_drafts
    # Cap so that the tokens this step may emit (1 + k) stay within max_model_len and max_tokens.
    room = min(max_model_len - end, request.sampling_params.max_tokens - request.num_output_tokens - placeholders) - 1
    return max(0, min(wanted, room, budget_left))


@dataclass
class SpecDecodeCounters:
    """Cumulative counts with vLLM's meaning: a draft = one request's drafts verified in one step."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos.extend([0] * (num_draft_tokens - len(self.accepted_per_pos)))
        for position in range(num_accepted):  # at most K iterations, once per verified request
            self.accepted_per_pos[position] += 1

    def stats(self) -> SpecDecodingStats:
        return SpecDecodingStats(num_drafts=self.num_drafts, num_draft_tokens=self.num_draft_tokens,
                                 num_accepted_tokens=self.num_accepted_tokens,
                                 num_accepted_tokens_per_pos=list(self.accepted_per_pos))
