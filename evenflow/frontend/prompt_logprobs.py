"""Prompt logprobs as vLLM returns them: one entry per prompt token, ``None`` for the first (it has
no position before it), else ``{token_id: Logprob}`` holding the prompt token and the top-k at its
position (k entries when the prompt token is among them, k + 1 when not)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from evenflow.frontend.generation import ChoiceJob
from evenflow.frontend.tokenizer import Tokenizer
from evenflow.protocol import PromptLogprobs


@dataclass
class Logprob:
    """vLLM's ``Logprob``: the value, its 1-based rank in the position's distribution, the text."""

    logprob: float
    rank: int
    decoded_token: str


PromptLogprobEntries = list[dict[int, Logprob] | None]


def prompt_logprob_entries(tokenizer: Tokenizer, rows: PromptLogprobs | None) -> PromptLogprobEntries:
    """The engine's rows (prompt tokens 1..; None: a one-token prompt has none) -> vLLM's
    per-token list, starting with None."""
    out: PromptLogprobEntries = [None]
    if rows is None:
        return out
    text = tokenizer.token_string
    for ids, values, rank in zip(rows.token_ids, rows.logprobs, rows.ranks):
        entry = {ids[0]: Logprob(values[0], rank, text(ids[0]))}
        for top_rank, (token_id, value) in enumerate(zip(ids[1:], values[1:]), start=1):
            entry.setdefault(token_id, Logprob(value, top_rank, text(token_id)))
        out.append(entry)
    return out


def prompt_logprobs_json(entries: PromptLogprobEntries) -> list[dict[str, dict[str, Any]] | None]:
    """The HTTP shape (vLLM's ``prompt_logprobs`` field): token ids as string keys."""
    return [None if e is None else
            {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
             for t, lp in e.items()}
            for e in entries]


def prompt_logprobs_by_prompt(tokenizer: Tokenizer, jobs: list[ChoiceJob]) -> dict[int, list[dict[str, Any] | None]]:
    """Each prompt's prompt logprobs in the HTTP shape, by prompt index (its first choice asked)."""
    return {job.prompt_index: prompt_logprobs_json(prompt_logprob_entries(tokenizer, job.assembler.prompt_logprobs))
            for job in jobs if job.params.prompt_logprobs is not None}
