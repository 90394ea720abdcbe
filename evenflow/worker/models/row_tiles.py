"""The row counts a CPU oneDNN GEMM is called with, kept to a fixed set of at most 104.

oneDNN builds (JIT-compiles) a primitive for every input shape it meets and keeps it in two
caches of 1024 entries (its own, ``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, and ideep's,
``LRU_CACHE_CAPACITY``); a primitive for one of SmolLM2's projections holds ~0.6 MB. A step's
row count is its token count, and serving meets every count up to the token budget, so the
worker grew by ~0.6 MB per new count and projection until both caches were full: hundreds of MB
(docs/results/reliability.md). A smaller cache would not do: building a primitive costs
milliseconds, which every step would pay again. So a GEMM of m rows runs on m rows when m <= 64
(decode batches: exact, as a decode step is bound by weight traffic and padding would cost
its share), else on tiles of 2048 rows and a tail rounded up to one of 8 sizes per octave (at most
12.5% of the tail is padding). The tiles are as large as the default token budget because smaller
ones cost a step's GEMMs: on a 2-core Xeon with AMX, 2042 rows in 512-row tiles took 1.5-2.1x one
call in bfloat16 (gate_up 3.21 against 2.10 ms, down 2.67 against 1.26) and 1.08-1.09x in float32
(``scripts/probe_kernel_choices.py --only tiles``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

EXACT_ROWS = 64
TILE_ROWS = 2048


def bucket_rows(rows: int) -> int:
    """``rows`` itself up to ``EXACT_ROWS``; above, the next multiple of 1/8 of its octave
    (65 -> 72, 129 -> 144, 257 -> 288; powers of two stay)."""
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << (rows.bit_length() - 4)  # rows in [2^k, 2^(k+1)): steps of 2^(k-3)
    return -(-rows // step) * step


def row_counts_used(rows: int) -> list[int]:
    """The row count of every GEMM call ``in_row_tiles`` makes for an input of ``rows`` rows."""
    if rows <= EXACT_ROWS:
        return [rows]
    full, tail = divmod(rows, TILE_ROWS)
    if tail == 0:
        return [TILE_ROWS] * full
    return [TILE_ROWS] * full + [bucket_rows(tail)]


def in_row_tiles(gemm: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``gemm(x)`` for a row-wise ``gemm`` ([m, k] -> [m, n]), called only on row counts that
    ``row_counts_used`` names; padding rows are zeros and are dropped from the result."""
    rows = x.shape[0]
    if rows <= EXACT_ROWS:
        return gemm(x)
    outs = []
    start = 0
    for count in row_counts_used(rows):
        take = min(count, rows - start)
        part = x[start : start + take]
        if take < count:
            padded = x.new_zeros((count, *x.shape[1:]))
            padded[:take] = part
            part = padded
        outs.append(gemm(part)[:take])
        start += take
    return outs[0] if len(outs) == 1 else torch.cat(outs)
