"""Structured output on the worker: apply the engine-core's token bitmasks to a step's logits.

The engine-core computes each structured request's allowed-token bitmask (its grammar's state
after every token it has, see evenflow/core/sched/structured_output.py) and sends it with the step; here the
disallowed tokens' logits become ``-inf`` before sampling. Unpacking is vectorized (numpy bit
unpacking, one ``masked_fill`` for the batch).
"""

from __future__ import annotations

import numpy as np
import torch

from evenflow.protocol import SchedulerOutput


@torch.inference_mode()
def apply_grammar_bitmask(logits: torch.Tensor, row_req_ids: list[str], so: SchedulerOutput,
                          vocab_size: int) -> torch.Tensor:
    """``logits [rows, >= vocab]`` (row i samples for ``row_req_ids[i]``) with every token the
    structured requests' grammars forbid set to ``-inf``: a new float32 tensor [rows, vocab_size].

    A token id beyond the bitmask's width (a model vocabulary wider than the tokenizer's) is
    forbidden; a structured request not sampling this step is ignored.
    """
    masked = logits[:, :vocab_size].float()
    if masked.data_ptr() == logits.data_ptr():
        masked = masked.clone()  # the caller's tensor is never modified
    row_of = {req_id: row for row, req_id in enumerate(row_req_ids)}
    pairs = [(i, row_of[req_id]) for i, req_id in enumerate(so.structured_output_req_ids) if req_id in row_of]
    if not pairs:
        return masked
    num_masks = len(so.structured_output_req_ids)
    words = np.frombuffer(so.grammar_bitmask, dtype="<i4").reshape(num_masks, -1)
    mask_rows, logit_rows = (list(t) for t in zip(*pairs))
    # Little-endian bytes + little bit order: bit j of word w is token 32*w + j.
    bits = np.unpackbits(words[mask_rows].view(np.uint8), axis=1, bitorder="little")
    width = min(vocab_size, bits.shape[1])
    # An additive bias, 0 where allowed and -inf where not, built with arithmetic: a boolean
    # masked_fill over [rows, vocab] is ~3x slower on CPU. (bit - 1) * 3e38 * 10 overflows to
    # -inf exactly where the bit is 0 (IEEE), and stays 0 where it is 1.
    bias = torch.from_numpy(bits[:, :width]).to(masked.device).float().sub_(1.0).mul_(3e38).mul_(10.0)
    if width < vocab_size:
        bias = torch.cat([bias, bias.new_full((len(pairs), vocab_size - width), float("-inf"))], dim=1)
    masked.index_add_(0, torch.tensor(logit_rows, device=masked.device), bias)
    return masked
