"""The LM head beside int4 projections: screened in bfloat16, the leading logits recomputed in float32.

At one row the head is a GEMV over the whole vocabulary, and its float32 table is the largest read
of an int4 decode step (SmolLM2: 113 MB of the 180 MB a step reads). A bfloat16 copy reads half, but
its logits come out rounded to bfloat16 (0.125 apart near 25), which ties real top-2 choices and
changed SmolLM2's greedy answers. So ``ScreenedHead`` computes every logit from the bfloat16 copy and
then recomputes the ``SCREEN_TOP`` highest of each row from the float32 table: the tokens greedy
decoding, top-k/top-p sampling and the top logprobs look at carry float32 logits of the same hidden
state, the tail keeps its bfloat16 value (an error of ~0.1 on logits far below the leader, which the
int4 projections' own error, ~0.06 mean, is already of the size of).

Used where the projections are int4 and the CPU has native bfloat16 (oneDNN-packed bf16 GEMV, 2.3x
faster than float32 at one row here); elsewhere the head is the plain dense linear.
"""

from __future__ import annotations

import torch
from evenflow.worker.models.linear import PackedCpuLinear

SCREEN_TOP = 64  # float32 logits per row: more than the 20 top logprobs a request can ask for
_ROWS_PER_GATHER = 64  # rows whose SCREEN_TOP table rows are gathered at once (64 x 64 x hidden floats)


class ScreenedHead:
    """``__call__(x)``: float32 logits [rows, vocab] of ``x`` against ``table`` [vocab, hidden] (float32)."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table  # float32, read only at the SCREEN_TOP rows of each step's leaders
        self.kernel = PackedCpuLinear()
        self.screen = self.kernel.prepare(table.to(torch.bfloat16))

    def step_nbytes(self, rows: int) -> int:
        """Bytes of weights a step of ``rows`` rows reads: the bf16 table once, SCREEN_TOP float32 rows a row."""
        vocab, hidden = self.table.shape
        return vocab * hidden * 2 + rows * min(SCREEN_TOP, vocab) * hidden * 4

    @staticmethod
    def works() -> bool:
        return PackedCpuLinear.works(torch.bfloat16)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        logits = self.kernel(x.to(torch.bfloat16), self.screen, None).float()
        top = logits.topk(min(SCREEN_TOP, logits.shape[1]), dim=1, sorted=False).indices
        for start in range(0, x.shape[0], _ROWS_PER_GATHER):
            rows = slice(start, start + _ROWS_PER_GATHER)
            idx = top[rows]
            leaders = self.table.index_select(0, idx.reshape(-1)).view(*idx.shape, -1)
            exact = torch.bmm(leaders, x[rows].unsqueeze(-1)).squeeze(-1)
            logits[rows].scatter_(1, idx, exact)
        return logits
