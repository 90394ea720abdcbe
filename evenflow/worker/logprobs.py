"""Logprobs of sampled tokens and their top-n alternatives, batched.

Which distribution: like vLLM V1's default (``logprobs_mode="raw_logprobs"``), logprobs are
``log_softmax`` of the model's *raw* logits, before penalties, ``min_tokens`` masking,
temperature, top-k/top-p/min-p. So a reported logprob says what the model thinks of a token,
independently of how the request chose to sample; it is the same for a token whatever the
sampling params are, and the sampled token can have any rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from evenflow.protocol import TokenLogprobs


@dataclass
class LogprobsMetadata:
    """Which rows asked for logprobs, and how many alternatives each wants."""

    rows: torch.Tensor | None  # long [L] on device; None when every row asked
    row_list: list[int]  # the same rows, on the host
    num_top: list[int]  # alternatives wanted per asked row (SamplingParams.logprobs)
    max_top: int


def build_logprobs_metadata(
    rows: list[int], num_top: list[int], num_reqs: int, device: torch.device
) -> LogprobsMetadata:
    """Describe the rows asking for logprobs (``num_top[i]`` alternatives for ``rows[i]``)."""
    all_rows = len(rows) == num_reqs
    return LogprobsMetadata(
        rows=None if all_rows else torch.tensor(rows, dtype=torch.long).to(device),
        row_list=rows,
        num_top=num_top,
        max_top=max(num_top, default=0),
    )


def compute_logprobs(
    raw_logits: torch.Tensor, sampled: torch.Tensor, meta: LogprobsMetadata, num_reqs: int
) -> list[TokenLogprobs | None]:
    """One ``TokenLogprobs`` per asked row (``None`` for others), from the raw logits.

    ``token_ids``/``logprobs`` hold the sampled token first, then the top ``n`` by logprob
    (which may include the sampled token again, as vLLM does). ``sampled_rank`` is 1 + the
    number of tokens with a strictly greater logprob.
    """
    logits = raw_logits if meta.rows is None else raw_logits.index_select(0, meta.rows)
    tokens = sampled if meta.rows is None else sampled.index_select(0, meta.rows)
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    sampled_logprob = logprobs.gather(1, tokens.unsqueeze(1))  # [L, 1]
    ranks = (logprobs > sampled_logprob).sum(dim=-1) + 1
    ids = tokens.unsqueeze(1)
    values = sampled_logprob
    num_top = min(meta.max_top, logprobs.shape[-1])
    if num_top > 0:
        top_values, top_ids = logprobs.topk(num_top, dim=-1)
        ids = torch.cat([ids, top_ids], dim=1)
        values = torch.cat([values, top_values], dim=1)
    # One transfer per tensor for the whole batch; the per-row loop only slices host lists.
    ids_host: list[list[int]] = ids.tolist()
    values_host: list[list[float]] = values.tolist()
    ranks_host: list[int] = ranks.tolist()
    out: list[TokenLogprobs | None] = [None] * num_reqs
    for j, (row, n) in enumerate(zip(meta.row_list, meta.num_top)):
        out[row] = TokenLogprobs(
            token_ids=ids_host[j][: n + 1],
            logprobs=values_host[j][: n + 1],
            sampled_rank=ranks_host[j],
        )
    return out
