"""Structured output on the worker: apply the engine-core's token bitmasks to a step's logits.

The engine-core computes each structured request's allowed-token bitmask (its grammar's state
after every token it has, see core/structured_output.py) and sends it with the step; here the
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
    allowed = np.unpackbits(words[mask_rows].view(np.uint8), axis=1, bitorder="little").astype(bool)
    forbidden = np.zeros((len(pairs), vocab_size), dtype=bool)
    width = min(vocab_size, allowed.shape[1])
    forbidden[:, :width] = ~allowed[:, :width]
    forbidden[:, width:] = True
    rows = torch.tensor(logit_rows, device=masked.device)
    sub = masked.index_select(0, rows)
    sub.masked_fill_(torch.from_numpy(forbidden).to(masked.device), float("-inf"))
    masked.index_copy_(0, rows, sub)
    return masked
