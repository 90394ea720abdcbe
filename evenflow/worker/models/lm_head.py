"""The LM head beside int4 projections: screened in bfloat16 or float16 (4-bit for argmax-only steps
of few rows), the leading logits recomputed in float32.

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
twice that to win. After the 4-bit product, that recompute is one C++ pass a row where it builds
(models/greedy_screen.py: ~8 PyTorch ops over the vocabulary before).

Used where the projections are int4. The bfloat16 screen only where the CPU has native bfloat16
(oneDNN-packed bf16 GEMV, 2.3x faster than float32 at one row on a Xeon with AMX); elsewhere (AVX2)
a float16 screen, FBGEMM's float16-weight GEMM (models/fp16_gemm.py; the same 57 MB, and its tail
logits within float16's 2^-11 rather than bfloat16's 2^-8), where the float32 table took 12 ms a
one-row step on a 2-core AVX2 EPYC (the 4-bit screen 2.3 ms, the float16 one ~3). Where neither
exists the float32 table computes every logit. The 4-bit screen is taken up to ``int4_rows`` rows,
the other above: its kernel dequantizes per row, so its cost grows with the rows where a
half-precision screen's, bound by its bytes, hardly does, and the crossover is the head's own, timed
at start-up (``for_cpu``): SmolLM2's head on a 2-core Xeon with AMX took 0.79 ms 4-bit against 1.27
bfloat16 at one row, 2.69 against 1.43 at eight, where the projections' plan keeps int4 to 8 rows
(``scripts/probe_kernel_choices.py --only head``).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from evenflow.worker.models.fp16_gemm import fp16_gemm_works, fp16_linear, pack_fp16
from evenflow.worker.models.greedy_screen import load_greedy_screen
from evenflow.worker.models.int4_gemv import TORCH_INT4_MM as _INT4_MM
from evenflow.worker.models.int4_gemv import (
    NO_GEMV, GemvRows, gemv_layout, gemv_rows, int4_product, load_int4_gemv,
)
from evenflow.worker.models.kernel_timing import on_every_core, time_min
from evenflow.worker.models.linear import Linear, PackedCpuLinear
from evenflow.worker.models.q4_blocks import GROUP, PACK_TILE_ROWS, Int4Weight, Q4Rows, pack

SCREEN_TOP = 64  # float32 logits per row: more than the 20 top logprobs a request can ask for
_ROWS_PER_GATHER = 64  # rows whose SCREEN_TOP table rows are gathered at once (64 x 64 x hidden floats)
_GREEDY_SIGMAS = 10.0  # see the module docstring
# Row counts at which the 4-bit screen times evenflow's GEMV (models/int4_gemv.py) against torch's kernel at
# start-up (on SmolLM2's 49152 x 576 table on a 2-core Xeon with AMX, ad hoc: 0.58-0.98x torch's time at one
# row, 0.79-0.84x at two, and with AMX 0.61-0.65x at four, 0.35-0.40x at six, 0.21-0.26x at 16).
_GEMV_PROBE_ROWS = (1, 2, 4, 8, 16)


class ScreenedHead:
    """``__call__(x)``: float32 logits [rows, vocab] of ``x`` against ``table`` [vocab, hidden] (float32)."""

    def __init__(self, table: torch.Tensor, screen: str = "bfloat16", dense: Linear | None = None,
                 int4_rows: int = 1 << 30) -> None:
        """``screen``: "bfloat16" (oneDNN), "float16" (FBGEMM) or "float32": ``dense``, the model's float32
        head kernel, whose logits are float32's already (then only plain greedy steps are screened, 4-bit).
        Plain greedy steps of up to ``int4_rows`` rows take the 4-bit screen."""
        self.table = table  # float32, read only at the SCREEN_TOP rows of each step's leaders (bf16 screen)
        self.kind = screen
        self.int4_rows = int4_rows
        if screen == "float32":
            assert dense is not None
            self.kernel: Linear = dense
            self.screen: torch.Tensor | torch.ScriptObject = dense.prepare(table)
        elif screen == "float16":
            self.screen = pack_fp16(table)
        else:
            self.kernel = PackedCpuLinear()
            self.screen = self.kernel.prepare(table.to(torch.bfloat16))
        self.int4 = Int4Screen(table) if Int4Screen.fits(table) else None

    @property
    def exact(self) -> bool:
        """Every logit float32's (no screen but on plain greedy steps)."""
        return self.kind == "float32"

    @classmethod
    def for_cpu(cls, table: torch.Tensor, bf16_fast: bool, dense: Linear, int4_rows: int) -> ScreenedHead | None:
        """The head for this CPU (``bf16_fast``: native bfloat16; ``dense``: the model's float32 head
        kernel), or None where it would screen nothing (no bfloat16, float16 or int4 kernel): ``dense`` alone."""
        if bf16_fast and cls.works():
            head = cls(table, int4_rows=int4_rows)
        elif fp16_gemm_works():
            head = cls(table, "float16", int4_rows=int4_rows)
        elif Int4Screen.fits(table):
            head = cls(table, "float32", dense, int4_rows)
        else:
            return None
        head.int4_rows = head.measured_int4_rows(int4_rows)
        return head

    def measured_int4_rows(self, cap: int) -> int:
        """The most rows, of 1, 2, 4, ... and ``cap``, up to ``cap``, at which the 4-bit screen's GEMM
        beat the other screen's on this table (min of interleaved trials, on every core); 0: never, or
        no 4-bit screen."""
        if self.int4 is None or cap < 1:
            return 0
        cap = min(cap, _GEMV_PROBE_ROWS[-1] * 16)  # a plan with int4 at every row count gives no bound
        probes = sorted({cap, *(1 << i for i in range(cap.bit_length()) if 1 << i <= cap)})
        g = torch.Generator().manual_seed(0)
        best = 0
        with on_every_core(), torch.inference_mode():
            for rows in probes:
                x = torch.randn(rows, self.table.shape[1], generator=g)
                int4_s, other_s = time_min([lambda: self.int4(x), lambda: self._screen_logits(x)])
                if int4_s >= other_s:
                    break
                best = rows
        return best

    def _screen_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Every logit of float32 ``x`` from the screen table (float32's own for the float32 kind)."""
        if self.kind == "float32":
            return self.kernel(x, self.screen, None)
        if self.kind == "float16":
            return fp16_linear(x, self.screen)
        return self.kernel(x.to(torch.bfloat16), self.screen, None).float()

    def _int4_screens(self, rows: int, greedy: bool) -> bool:
        return greedy and self.int4 is not None and rows <= self.int4_rows

    def step_nbytes(self, rows: int, greedy: bool = False) -> int:
        """Bytes of weights a step of ``rows`` rows reads: the half-precision table once, SCREEN_TOP float32
        rows a row (``greedy`` up to ``int4_rows``: the 4-bit table once, the recomputed rows left out)."""
        vocab, hidden = self.table.shape
        if self._int4_screens(rows, greedy):
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
        if self._int4_screens(x.shape[0], greedy):
            return self._greedy(x)
        logits = self._screen_logits(x)
        if not self.exact:
            self._recompute_top(x, logits)
        return logits

    def _greedy(self, x: torch.Tensor) -> torch.Tensor:
        # No top-k here (0.2 ms at 49k logits): the screen's leader recomputed gives a floor the argmax
        # reaches, and every token that may reach it is recomputed too; in one C++ pass where it builds.
        finish = load_greedy_screen()
        if finish is not None:
            return finish(self.int4.bf16_logits(x), x, self.table, self.int4.row_error, _GREEDY_SIGMAS)
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
        self.weight: Int4Weight = gemv_layout(pack(Q4Rows(q.to(torch.uint8).view(rows, hidden), scale, zero)))
        self.gemv_rows = self._measured_gemv_rows()  # the row counts the GEMV computes the screen at
        if self.gemv_rows == NO_GEMV:  # torch's kernel reads torch's order only
            self.weight = replace(self.weight, strip_scales=None)
        # Per row, the RMS of its rounding error: a logit's error has standard deviation |x| * this.
        self.row_error = (groups - values)[:vocab].pow(2).mean((1, 2)).sqrt().unsqueeze(0)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 screen logits [rows, vocab], each row's |x| [rows, 1])."""
        return self.bf16_logits(x)[:, : self.vocab].float(), x.norm(dim=1, keepdim=True)

    def bf16_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The screen's product [rows, vocab padded to 64] in bfloat16, by the GEMV at ``gemv_rows``."""
        return int4_product(x.to(torch.bfloat16), self.weight, self.gemv_rows)

    def _measured_gemv_rows(self) -> GemvRows:
        """``gemv_rows`` of the GEMV against torch's kernel on this table (NO_GEMV: none here)."""
        gemv = load_int4_gemv()
        if gemv is None:
            return NO_GEMV
        w, g = self.weight, torch.Generator().manual_seed(0)
        timings = {}
        with on_every_core(), torch.inference_mode():
            for rows in _GEMV_PROBE_ROWS:
                x = torch.randn(rows, w.in_features, generator=g).bfloat16()
                timings[rows] = tuple(time_min([lambda: _INT4_MM(x, w.packed, GROUP, w.scale_zeros),
                                                lambda: gemv(x, w)]))
        return gemv_rows(timings)
