"""row_tiles: every row count maps onto a fixed set of GEMM row counts, and the tiled GEMM equals
the plain one (torch's F.linear as the reference), through the kernels that use it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from evenflow.worker.models.linear import PackedCpuLinear
from evenflow.worker.models.row_tiles import (
    EXACT_ROWS,
    TILE_ROWS,
    bucket_rows,
    in_row_tiles,
    row_counts_used,
)


def test_row_counts_are_a_fixed_set_with_little_padding() -> None:
    used: set[int] = set()
    for rows in range(1, 8193):
        counts = row_counts_used(rows)
        used.update(counts)
        assert sum(counts) >= rows
        tail = rows % TILE_ROWS or min(rows, TILE_ROWS)
        assert sum(counts) - rows <= tail // 8  # at most 12.5% of the tail is padding
    assert used == set(range(1, EXACT_ROWS + 1)) | {bucket_rows(r) for r in range(EXACT_ROWS + 1, TILE_ROWS + 1)}
    assert len(used) == 104


def test_tiled_gemm_matches_f_linear_and_sees_only_bucketed_rows() -> None:
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 40, generator=g), torch.randn(96, generator=g)
    seen: list[int] = []

    def gemm(rows: torch.Tensor) -> torch.Tensor:
        seen.append(rows.shape[0])
        return F.linear(rows, w, b)

    for rows in (1, 63, 64, 65, 300, 512, 513, 1100, 2048):
        x = torch.randn(rows, 40, generator=g)
        seen.clear()
        out = in_row_tiles(gemm, x)
        assert seen == row_counts_used(rows)
        torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_packed_linear_matches_f_linear_above_the_exact_rows() -> None:
    if not PackedCpuLinear.works():
        import pytest

        pytest.skip("this torch has no oneDNN packed linear")
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(64, 48, generator=g), torch.randn(64, generator=g)
    kernel = PackedCpuLinear()
    packed = kernel.prepare(w)
    for rows in (7, 65, 777):
        x = torch.randn(rows, 48, generator=g)
        torch.testing.assert_close(kernel(x, packed, b), F.linear(x, w, b), rtol=1e-4, atol=1e-4)
