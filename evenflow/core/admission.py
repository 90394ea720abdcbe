"""Admission limits: refuse a new request cheaply, at arrival, instead of queueing without bound.

``--max-num-queued-reqs`` caps the requests the engine holds (waiting + running);
``--max-num-queued-tokens`` caps the prompt tokens not yet computed across them (the prefill work
queued ahead of a newcomer). Only new requests are checked: a preempted request is already held and
is never refused. The refusal names the limit first, so a client can label it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from evenflow.core.request import Request

REASON_REQS = "max_num_queued_reqs"
REASON_TOKENS = "max_num_queued_tokens"


@dataclass(frozen=True)
class AdmissionLimits:
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None

    def refusal(self, held: Iterable[Request], num_held: int, num_prompt_tokens: int) -> str | None:
        """Why a new request of ``num_prompt_tokens`` cannot be taken now, or None when it can.

        ``held`` is every request the scheduler holds (``num_held`` of them)."""
        if self.max_num_queued_reqs is not None and num_held >= self.max_num_queued_reqs:
            return (f"{REASON_REQS}: the engine holds {num_held} requests, its limit "
                    f"(--max-num-queued-reqs) is {self.max_num_queued_reqs}; retry later")
        if self.max_num_queued_tokens is not None:
            queued = sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in held)
            if queued + num_prompt_tokens > self.max_num_queued_tokens:
                return (f"{REASON_TOKENS}: {queued} prompt tokens are queued and this request adds "
                        f"{num_prompt_tokens}, over the limit (--max-num-queued-tokens) of "
                        f"{self.max_num_queued_tokens}; retry later")
        return None
