"""The LM head beside int4 projections: screened in bfloat16 (4-bit for argmax-only steps), the
leading logits recomputed in float32.

At one row the head is a GEMV over the whole vocabulary, and its float32 table is the largest read
of an int4 decode step (SmolLM2: 113 MB of the 180 MB a step reads). A bfloat16 copy reads half, but
its logits come out rounded to bfloat16 (0.125 apart near 25), which ties real top-2 choices and
changed SmolLM2's greedy answers. So ``ScreenedHead`` computes every logit from the bfloat16 copy and
then recomputes the ``SCREEN_TOP`` highest of each row from the float32 table: the tokens greedy
decoding, top-k/top-p sampling and the top logprobs look at carry float32 logits of the same hidden
state, the tail keeps its bfloat16 value (an error of ~0.1 on logits far below the leader, which the
int4 projections' own error, ~0.06 mean, is already of the size of).

A step whose rows are all plain greedy reads nothing but each row's argmax, so ``greedy=True`` screens
with a 4-bit copy instead (groups of 32, a quarter of the bfloat16 bytes; SmolLM2: 1.6 against 3.9 ms).
Its logits are too rough for anything but that argmax (error std ~0.5 on SmolLM2, worst 4.3), so the
tail is never handed to sampling or logprobs. To keep the argmax float32's, the screen's leader is
recomputed in float32 (the argmax is at least that value), and so is every token whose screen logit
lies within ``_GREEDY_SIGMAS`` of its own error scale of it. That scale, ``|x| * rms(table row - 4-bit
row)``, is the standard deviation of the row's rounding error against ``x``; over 7M real SmolLM2
logits the worst error was 4.9 of it, so a token left at its screen value would have to be off by
twice that to win.

Used where the projections are int4. The bfloat16 screen only where the CPU has native bfloat16
(oneDNN-packed bf16 GEMV, 2.3x faster than float32 at one row on a Xeon with AMX); elsewhere (AVX2)
a step that reads more than the argmax computes its logits from the float32 table, and plain greedy
steps still take the 4-bit screen (SmolLM2 on a 2-core AVX2 EPYC: the table's 113 MB read in float32
against 14 MB).
"""

from __future__ import annotations

import torch
from evenflow.worker.models.linear import Linear, PackedCpuLinear
from evenflow.worker.models.q4_blocks import GROUP, PACK_TILE_ROWS, Int4Weight, Q4Rows, pack

SCREEN_TOP = 64  # float32 logits per row: more than the 20 top logprobs a request can ask for
_ROWS_PER_GATHER = 64  # rows whose SCREEN_TOP table rows are gathered at once (64 x 64 x hidden floats)
_GREEDY_SIGMAS = 10.0  # see the module docstring
_INT4_MM = getattr(getattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", None), "default", None)


class ScreenedHead:
    """``__call__(x)``: float32 logits [rows, vocab] of ``x`` against ``table`` [vocab, hidden] (float32)."""

    def __init__(self, table: torch.Tensor, dense: Linear | None = None) -> None:
        """A bfloat16 screen (``dense`` None), or ``dense``, the model's float32 head kernel, whose
        logits are float32's already: then only plain greedy steps are screened (4-bit)."""
        self.table = table  # float32, read only at the SCREEN_TOP rows of each step's leaders (bf16 screen)
        self.exact = dense is not None
        self.kernel = dense if dense is not None else PackedCpuLinear()
        self.screen = self.kernel.prepare(table if self.exact else table.to(torch.bfloat16))
        self.int4 = Int4Screen(table) if Int4Screen.fits(table) else None

    @classmethod
    def for_cpu(cls, table: torch.Tensor, bf16_fast: bool, dense: Linear) -> ScreenedHead | None:
        """The head for this CPU (``bf16_fast``: native bfloat16; ``dense``: the model's float32 head
        kernel), or None where it would screen nothing (no bfloat16, no int4 kernel): ``dense`` alone."""
        if bf16_fast and cls.works():
            return cls(table)
        return cls(table, dense) if Int4Screen.fits(table) else None

    def step_nbytes(self, rows: int, greedy: bool = False) -> int:
        """Bytes of weights a step of ``rows`` rows reads: the bf16 table once, SCREEN_TOP float32 rows a
        row (``greedy``: the 4-bit table once, the recomputed rows left out, some tens a row)."""
        vocab, hidden = self.table.shape
        if greedy and self.int4 is not None:
            return self.int4.weight.nbytes
        if self.exact:
            return vocab * hidden * 4
        return vocab * hidden * 2 + rows * min(SCREEN_TOP, vocab) * hidden * 4

    @staticmethod
    def works() -> bool:
        return PackedCpuLinear.works(torch.bfloat16)

    def __call__(self, x: torch.Tensor, greedy: bool = False) -> torch.Tensor:
        """``greedy``: only each row's argmax will be read (it is float32's; the other logits may be rough)."""
        x = x.float()
        if greedy and self.int4 is not None:
            return self._greedy(x)
        if self.exact:
            return self.kernel(x, self.screen, None)
        logits = self.kernel(x.to(torch.bfloat16), self.screen, None).float()
        self._recompute_top(x, logits)
        return logits

    def _greedy(self, x: torch.Tensor) -> torch.Tensor:
        # No top-k here (0.2 ms at 49k logits): the screen's leader recomputed gives a floor the argmax
        # reaches, and every token that may reach it is recomputed too.
        logits, norm = self.int4(x)
        lead = logits.argmax(1, keepdim=True)
        floor = torch.bmm(self.table.index_select(0, lead.view(-1)).unsqueeze(1), x.unsqueeze(-1)).view(-1, 1)
        reach = torch.addcmul(logits, norm, self.int4.row_error, value=_GREEDY_SIGMAS)
        suspects = (reach >= floor).nonzero()
        logits.scatter_(1, lead, floor)
        if suspects.shape[0]:
            rows, cols = suspects.unbind(1)
            logits[rows, cols] = (self.table.index_select(0, cols) * x.index_select(0, rows)).sum(1)
        return logits

    def _recompute_top(self, x: torch.Tensor, logits: torch.Tensor) -> None:
        """Overwrite each row's SCREEN_TOP highest logits with float32's."""
        top = logits.topk(min(SCREEN_TOP, logits.shape[1]), dim=1, sorted=False).indices
        for start in range(0, x.shape[0], _ROWS_PER_GATHER):
            rows = slice(start, start + _ROWS_PER_GATHER)
            idx = top[rows]
            leaders = self.table.index_select(0, idx.reshape(-1)).view(*idx.shape, -1)
            exact = torch.bmm(leaders, x[rows].unsqueeze(-1)).squeeze(-1)
            logits[rows].scatter_(1, idx, exact)


class Int4Screen:
    """The table quantized once to 4 bits, groups of 32 (min/max; scale and zero as the kernel's bfloat16)."""

    @staticmethod
    def fits(table: torch.Tensor) -> bool:
        return _INT4_MM is not None and table.shape[1] % GROUP == 0

    def __init__(self, table: torch.Tensor) -> None:
        vocab, hidden = table.shape
        self.vocab = vocab
        rows = -(-vocab // PACK_TILE_ROWS) * PACK_TILE_ROWS  # the kernel packs whole 64-row tiles
        padded = table if rows == vocab else torch.cat((table, table.new_zeros(rows - vocab, hidden)))
        groups = padded.view(rows, hidden // GROUP, GROUP)
        lo, hi = groups.amin(-1), groups.amax(-1)
        scale = ((hi - lo) / 15).bfloat16().float()
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        zero = (lo + 8 * scale).bfloat16().float()  # value = (q - 8) * scale + zero
        q = ((groups - zero.unsqueeze(-1)) / scale.unsqueeze(-1) + 8).round().clamp(0, 15)
        values = (q - 8) * scale.unsqueeze(-1) + zero.unsqueeze(-1)
        self.weight: Int4Weight = pack(Q4Rows(q.to(torch.uint8).view(rows, hidden), scale, zero))
        # Per row, the RMS of its rounding error: a logit's error has standard deviation |x| * this.
        self.row_error = (groups - values)[:vocab].pow(2).mean((1, 2)).sqrt().unsqueeze(0)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 screen logits [rows, vocab], each row's |x| [rows, 1])."""
        w = self.weight
        logits = _INT4_MM(x.to(torch.bfloat16), w.packed, GROUP, w.scale_zeros)[:, : self.vocab].float()
        return logits, x.norm(dim=1, keepdim=True)
