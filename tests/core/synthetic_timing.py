"""A made-up machine for the budget controller: a step's time as a known function of what it holds."""

from __future__ import annotations

from dataclasses import dataclass

from evenflow.protocol import SchedulerOutput


@dataclass
class SyntheticMachine:
    """seconds = fixed + per_token * tokens + per_read * K/V tokens read + per_pair * (query, key)
    pairs + per_request * requests, times ``slowdown`` (another process taking a core). Reads are
    priced well above pairs, as on real hardware, where a decode's attention is memory-bound."""

    fixed: float = 2e-3
    per_token: float = 20e-6
    per_read: float = 0.2e-6
    per_pair: float = 2e-9
    per_request: float = 50e-6
    slowdown: float = 1.0
    num_layers: int = 1  # a request in ``layer_spans`` costs its span's share of its tokens, reads and pairs

    def step_seconds(self, output: SchedulerOutput) -> float:
        computed = {new.req_id: new.num_computed_tokens for new in output.scheduled_new_reqs}
        computed.update((cached.req_id, cached.num_computed_tokens) for cached in output.scheduled_cached_reqs)
        share = {req_id: (end - start) / self.num_layers for req_id, (start, end) in output.layer_spans.items()}
        scheduled = output.num_scheduled_tokens.items()
        pairs = sum(share.get(r, 1.0) * n * (computed[r] + (n + 1) / 2) for r, n in scheduled)
        reads = sum(share.get(r, 1.0) * (computed[r] + n) for r, n in scheduled)
        tokens = sum(share.get(r, 1.0) * n for r, n in scheduled)
        requests = len(output.num_scheduled_tokens)
        seconds = (self.fixed + self.per_token * tokens + self.per_read * reads + self.per_pair * pairs
                   + self.per_request * requests)
        return seconds * self.slowdown
