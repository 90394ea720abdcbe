"""Checks on a submitted request that need no scheduler state (run on the frontend IO thread)."""

from __future__ import annotations

from evenflow.protocol import AddRequest


def validate_add_request(req: AddRequest, vocab_size: int, max_model_len: int) -> str | None:
    """Return a message naming what is wrong with ``req``, or None when it can be scheduled."""
    if not req.request_id:
        return "request_id must be a non-empty string"
    ids = req.prompt_token_ids
    if not ids:
        return "prompt is empty: at least one prompt token id is required"
    # min/max run in C; only on a failure do we look for the position to report.
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        return (f"prompt token id {bad} at position {ids.index(bad)} is outside the vocabulary "
                f"[0, {vocab_size})")
    if not (0.0 <= req.arrival_time < float("inf")):  # NaN would corrupt the priority order
        return f"arrival_time must be a finite unix time >= 0 (0 = now), got {req.arrival_time}"
    problem = req.sampling_params.validate(vocab_size)
    if problem is not None:
        return problem
    n_prompt, n_out = len(ids), req.sampling_params.max_tokens
    if n_prompt + n_out > max_model_len:
        return (f"prompt ({n_prompt} tokens) + max_tokens ({n_out}) = {n_prompt + n_out} tokens exceeds "
                f"max_model_len ({max_model_len})")
    return None
