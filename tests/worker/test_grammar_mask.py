"""The worker applies the engine's grammar bitmasks: forbidden tokens get -inf, nothing else moves."""

from __future__ import annotations

import numpy as np
import torch
from evenflow.protocol import SchedulerOutput
from evenflow.worker.grammar_mask import apply_grammar_bitmask


def step(req_ids: list[str], allowed: list[list[int]], vocab: int) -> SchedulerOutput:
    words = np.zeros((len(req_ids), (vocab + 31) // 32), dtype=np.uint32)
    for row, tokens in enumerate(allowed):
        for t in tokens:
            words[row, t // 32] |= np.uint32(1 << (t % 32))
    return SchedulerOutput(0, [], [], {}, 0, structured_output_req_ids=req_ids,
                           grammar_bitmask=words.astype("<u4").tobytes())


def test_masks_only_the_structured_rows_and_never_the_callers_tensor() -> None:
    vocab = 70  # not a multiple of 32: the last word is partly padding
    logits = torch.randn(3, vocab + 2)  # a wider logits row (padded vocabulary) is cut to the vocabulary
    original = logits.clone()
    so = step(["b", "gone", "a"], [[0, 33, 69], [1], [5]], vocab)
    out = apply_grammar_bitmask(logits, ["a", "plain", "b"], so, vocab)
    assert torch.equal(logits, original) and out.shape == (3, vocab) and out.dtype == torch.float32
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [5]
    assert torch.equal(out[1], original[1, :vocab])  # not structured: untouched
    assert torch.isfinite(out[2]).nonzero().flatten().tolist() == [0, 33, 69]
    assert torch.equal(out[2, [0, 33, 69]], original[2, [0, 33, 69]])


def test_tokens_past_the_bitmask_width_are_forbidden() -> None:
    so = step(["a"], [[31]], 32)
    out = apply_grammar_bitmask(torch.zeros(1, 40, dtype=torch.float16), ["a"], so, 40)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [31]
