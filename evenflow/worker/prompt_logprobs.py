"""Prompt logprobs (vLLM's ``SamplingParams.prompt_logprobs``): for every prompt token after the
first, its logprob and the top-k at its position, from the raw logits as ``logprobs.py`` does.

The logits at position ``p`` predict token ``p + 1``, so a prefill chunk over positions
``[c, c + n)`` yields the rows of prompt tokens ``c + 1 .. c + n`` (the last chunk stops at the
prompt's last token: its last position predicts the first sampled token, which is the sampler's). The model
computes logits only where asked, so ``plan`` names these extra rows, appended after the
sampling rows of the step, and ``compute`` turns their logits into ``PromptLogprobs``.

A request reports each prompt token once: ``PromptLogprobsTracker`` remembers how far it got, so
a request recomputed after preemption does not report its prompt again.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from evenflow.protocol import PromptLogprobs, SchedulerOutput
from evenflow.worker.batch import StepInputs


@dataclass
class PromptLogprobsPlan:
    """The step's extra logits rows, request by request."""

    indices: torch.Tensor  # [R] long: rows of the step's tokens whose logits are wanted
    targets: torch.Tensor  # [R] long: the prompt token each row predicts
    req_ids: list[str]
    counts: list[int]  # rows per request, in order
    num_top: list[int]  # k per request


class PromptLogprobsTracker:
    """Which requests want prompt logprobs and the next prompt token each still has to report."""

    def __init__(self) -> None:
        self._next: dict[str, int] = {}  # req_id -> first prompt index not yet reported

    def update(self, so: SchedulerOutput) -> None:
        """Learn the step's new requests that ask, forget finished ones (before ``plan``)."""
        for req_id in so.finished_req_ids:
            self._next.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            if new.sampling_params.prompt_logprobs is not None:
                self._next[new.req_id] = 1  # the first prompt token has no row

    def wants(self, req_id: str) -> bool:
        """Whether ``req_id`` still has prompt logprobs to report."""
        return req_id in self._next

    def plan(self, inputs: StepInputs) -> PromptLogprobsPlan | None:
        """The rows this step must add to the logits, or None when no request needs any."""
        if not self._next:  # the common step: nothing per request
            return None
        rows: list[np.ndarray] = []
        targets: list[list[int]] = []
        plan_ids: list[str] = []
        counts: list[int] = []
        num_top: list[int] = []
        starts = inputs.attn.query_start_loc_np
        for i, state in enumerate(inputs.requests):
            first = self._next.get(state.req_id)
            if first is None:
                continue
            k = state.sampling.params.prompt_logprobs
            num_prompt = len(state.prompt_token_ids)
            computed = state.num_computed_tokens
            # Prompt tokens whose predicting position lies in this chunk and not reported yet.
            lo = max(computed + 1, first)
            hi = min(computed + int(starts[i + 1] - starts[i]) + 1, num_prompt)
            if hi <= lo:
                continue
            rows.append(np.arange(lo - 1 - computed, hi - 1 - computed, dtype=np.int64) + int(starts[i]))
            targets.append(state.prompt_token_ids[lo:hi])
            plan_ids.append(state.req_id)
            counts.append(hi - lo)
            num_top.append(int(k or 0))
            self._next[state.req_id] = hi
        if not rows:
            return None
        device = inputs.logits_indices.device
        return PromptLogprobsPlan(
            indices=torch.from_numpy(np.concatenate(rows)).to(device),
            targets=torch.tensor([t for ts in targets for t in ts], dtype=torch.long, device=device),
            req_ids=plan_ids,
            counts=counts,
            num_top=num_top,
        )


def compute_prompt_logprobs(logits: torch.Tensor, plan: PromptLogprobsPlan) -> dict[str, PromptLogprobs]:
    """``logits`` [R, vocab] (the plan's rows) -> each request's rows of this step."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    target_logprobs = logprobs.gather(1, plan.targets.unsqueeze(1))  # [R, 1]
    ranks = (logprobs > target_logprobs).sum(dim=-1) + 1
    ids, values = plan.targets.unsqueeze(1), target_logprobs
    max_top = min(max(plan.num_top), logprobs.shape[-1])
    if max_top > 0:
        top_values, top_ids = logprobs.topk(max_top, dim=-1)
        ids = torch.cat([ids, top_ids], dim=1)
        values = torch.cat([values, top_values], dim=1)
    ids_host, values_host, ranks_host = ids.cpu(), values.cpu(), ranks.cpu()
    out: dict[str, PromptLogprobs] = {}
    start = 0
    # One slice per request; the rows come out of tolist() whole.
    for req_id, n, k in zip(plan.req_ids, plan.counts, plan.num_top):
        end = start + n
        out[req_id] = PromptLogprobs(ids_host[start:end, : k + 1].tolist(), values_host[start:end, : k + 1].tolist(),
                                     ranks_host[start:end].tolist())
        start = end
    return out


def logits_rows(inputs: StepInputs, plan: PromptLogprobsPlan | None) -> torch.Tensor:
    """The rows the model computes logits for: the sampling rows, then the plan's."""
    return inputs.logits_indices if plan is None else torch.cat([inputs.logits_indices, plan.indices])


def split_prompt_logits(logits: torch.Tensor, inputs: StepInputs, plan: PromptLogprobsPlan | None,
                        report: bool) -> tuple[torch.Tensor, dict[str, PromptLogprobs] | None]:
    """(the sampling rows' logits, the prompt logprobs when ``report``: rank 0 only)."""
    if plan is None:
        return logits, None
    num_sample_rows = inputs.logits_indices.shape[0]
    prompt = compute_prompt_logprobs(logits[num_sample_rows:], plan) if report else None
    return logits[:num_sample_rows], prompt
