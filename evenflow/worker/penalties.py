"""Logit processors that look at a request's history: penalties and ``min_tokens``.

Both work on flat index arrays (``row * vocab + token``) built on the CPU with numpy, one
host-to-device copy each, and are applied by gathering and scattering just those logits: a few
tensor ops per step, never a loop per token.

Semantics (the ones vLLM and the OpenAI API use):

* repetition penalty (HF / vLLM): for every token seen in the prompt *or* the output, a positive
  logit is divided by the penalty and a non-positive one multiplied by it;
* frequency penalty (OpenAI): ``logit -= frequency_penalty * count_in_output``;
* presence penalty (OpenAI): ``logit -= presence_penalty * (count_in_output > 0)``;

applied in that order. ``min_tokens`` masks stop tokens (EOS unless ``ignore_eos``, plus
``stop_token_ids``) to ``-inf`` while the output is shorter than ``min_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from evenflow.protocol import SamplingParams

# Rows needing no processor share this empty array, so concatenation stays cheap.
_EMPTY_IDS = np.zeros(0, dtype=np.int64)


def has_penalties(params: SamplingParams) -> bool:
    """True when any penalty of ``params`` changes logits."""
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
    )


@dataclass
class PenaltyMetadata:
    """Penalties of the rows that have any, ready to apply to a ``[num_reqs, vocab]`` tensor.

    Penalties only change the logits of tokens a request has seen, so they are applied to those
    entries alone (a gather, a few ops on them, a scatter) instead of to whole rows.
    """

    seen_flat: torch.Tensor  # long [S]: row * vocab + token into the logits; output tokens first
    seen_local: torch.Tensor  # long [S]: penalty-row index (0..P-1) of each seen token
    count_flat: torch.Tensor  # long [S]: local_row * vocab + token into a [P, vocab] count table
    num_output_tokens: int  # the first entries of seen_* are every output token (repeats kept)
    num_rows: int  # P
    repetition: torch.Tensor  # float32 [P]
    frequency: torch.Tensor  # float32 [P]
    presence: torch.Tensor  # float32 [P]
    use_repetition: bool
    use_output_penalties: bool  # any frequency or presence penalty


def build_penalty_metadata(
    rows: list[int],
    params: list[SamplingParams],
    prompt_unique_ids: list[np.ndarray],
    output_ids: list[np.ndarray],
    vocab_size: int,
    device: torch.device,
) -> PenaltyMetadata:
    """Pack the penalties of batch ``rows`` (aligned lists) into device tensors.

    ``prompt_unique_ids`` are the distinct in-vocabulary prompt tokens of each row (only read for
    rows with a repetition penalty); ``output_ids`` every output token so far.
    """
    factors = np.array(
        [(p.repetition_penalty, p.frequency_penalty, p.presence_penalty) for p in params],
        dtype=np.float32,
    ).reshape(len(params), 3)
    use_repetition = bool((factors[:, 0] != 1.0).any())
    use_output_penalties = bool((factors[:, 1:] != 0.0).any())
    local_rows = np.arange(len(rows), dtype=np.int64)
    out_local, out_tokens = _row_and_token(output_ids, local_rows, vocab_size)
    if use_repetition:
        prompts = [
            ids if p.repetition_penalty != 1.0 else _EMPTY_IDS
            for ids, p in zip(prompt_unique_ids, params)
        ]
        prompt_local, prompt_tokens = _row_and_token(prompts, local_rows, vocab_size)
        seen_local = np.concatenate([out_local, prompt_local])
        seen_tokens = np.concatenate([out_tokens, prompt_tokens])
    else:
        seen_local, seen_tokens = out_local, out_tokens
    global_rows = np.asarray(rows, dtype=np.int64)
    # One host-to-device copy for the three index arrays, one for the factors.
    indices = np.stack(
        [global_rows[seen_local] * vocab_size + seen_tokens, seen_local,
         seen_local * vocab_size + seen_tokens]
    )  # fmt: skip
    indices_dev = torch.from_numpy(indices).to(device, non_blocking=True)
    factors_dev = torch.from_numpy(np.ascontiguousarray(factors.T)).to(device, non_blocking=True)
    return PenaltyMetadata(
        seen_flat=indices_dev[0],
        seen_local=indices_dev[1],
        count_flat=indices_dev[2],
        num_output_tokens=int(out_tokens.size),
        num_rows=len(rows),
        repetition=factors_dev[0],
        frequency=factors_dev[1],
        presence=factors_dev[2],
        use_repetition=use_repetition,
        use_output_penalties=use_output_penalties,
    )


def apply_penalties(logits: torch.Tensor, meta: PenaltyMetadata) -> None:
    """Apply penalties in place to the float32, contiguous ``logits [num_reqs, vocab]``.

    Tokens seen several times appear several times in the index; every copy computes the same
    value from the same original logit, so the final scatter is well defined.
    """
    if meta.seen_flat.numel() == 0:
        return
    flat_logits = logits.view(-1)
    values = flat_logits[meta.seen_flat]
    if meta.use_repetition:
        repetition = meta.repetition[meta.seen_local]
        values = torch.where(values > 0, values / repetition, values * repetition)
    if meta.use_output_penalties:
        vocab = logits.shape[-1]
        counts = torch.zeros(meta.num_rows * vocab, dtype=values.dtype, device=values.device)
        output_flat = meta.count_flat[: meta.num_output_tokens]
        counts.index_add_(0, output_flat, torch.ones_like(output_flat, dtype=values.dtype))
        seen_counts = counts[meta.count_flat]
        values = values - (
            meta.frequency[meta.seen_local] * seen_counts
            + meta.presence[meta.seen_local] * (seen_counts > 0)
        )
    flat_logits[meta.seen_flat] = values


def build_min_tokens_flat(
    rows: list[int], stop_ids: list[list[int]], vocab_size: int, device: torch.device
) -> torch.Tensor | None:
    """Flat indices ``row * vocab + token`` of the stop tokens to mask, or None if none."""
    arrays = [np.asarray(ids, dtype=np.int64) for ids in stop_ids]
    row_of_token, tokens = _row_and_token(arrays, np.asarray(rows, dtype=np.int64), vocab_size)
    flat = row_of_token * vocab_size + tokens
    if flat.size == 0:
        return None
    return torch.from_numpy(flat).to(device, non_blocking=True)


def apply_min_tokens(logits: torch.Tensor, flat: torch.Tensor) -> None:
    """Mask stop tokens in place (``logits`` float32, contiguous)."""
    logits.view(-1).index_fill_(0, flat, float("-inf"))


def _row_and_token(
    ids_per_row: list[np.ndarray], row_numbers: np.ndarray, vocab_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Flatten per-row token arrays to (row number, token) pairs, dropping out-of-vocab ids."""
    if not ids_per_row:
        return _EMPTY_IDS, _EMPTY_IDS
    lengths = np.fromiter((a.size for a in ids_per_row), dtype=np.int64, count=len(ids_per_row))
    tokens = np.concatenate(ids_per_row).astype(np.int64, copy=False)
    row_of_token = np.repeat(row_numbers, lengths)
    valid = (tokens >= 0) & (tokens < vocab_size)
    if not valid.all():
        return row_of_token[valid], tokens[valid]
    return row_of_token, tokens
