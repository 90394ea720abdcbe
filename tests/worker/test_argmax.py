"""The sampler's row argmax (evenflow/worker/argmax.py): torch.argmax's answer on every kind of row (ties, NaN,
infinities, signed zeros, widths past the vector loops, strided rows, many rows on several threads)."""

from __future__ import annotations

import pytest
import torch

from evenflow.worker.argmax import _library, row_argmax


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    if _library() is None:
        pytest.skip("no C++ compiler for inductor's toolchain here")


def _rows(width: int, seed: int) -> torch.Tensor:
    """Rows of every case: random, ties of the maximum, a NaN early / late / in the tail, all -inf, zeros of
    both signs, +inf ties."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(10, width, generator=g)
    rows[1, [3 % width, width // 2, width - 1]] = 9.0  # three equal maxima
    rows[2, width // 3] = float("nan")
    rows[2, width - 1] = float("nan")
    rows[3, width - 1] = float("nan")  # in the scalar tail where the width is not a multiple of 16
    rows[4] = float("-inf")
    rows[5] = -1.0
    rows[5, [width // 4, width // 2]] = torch.tensor([-0.0, 0.0])
    rows[6, [1 % width, width - 2]] = float("inf")
    rows[7] = torch.arange(width, 0, -1).float()  # the first is the largest
    rows[8] = torch.arange(width).float()  # the last
    rows[9, width - 1] = 50.0
    return rows


@pytest.mark.parametrize("width", [1, 7, 8, 16, 17, 100, 49152, 49155])
@pytest.mark.parametrize("threads", [1, 2])
def test_it_gives_torchs_argmax_on_every_kind_of_row(width: int, threads: int) -> None:
    rows = _rows(width, seed=width)
    prior = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got = row_argmax(rows)
    finally:
        torch.set_num_threads(prior)
    assert got.dtype == torch.int64
    assert torch.equal(got, rows.argmax(dim=-1))
    for r in range(rows.shape[0]):  # one row at a time, as a one-row step samples
        assert torch.equal(row_argmax(rows[r:r + 1]), rows[r:r + 1].argmax(dim=-1))


def test_a_slice_of_wider_rows_is_read_at_its_stride() -> None:
    wide = _rows(300, seed=1)
    wide[:, 200:] = 1e9  # past the slice: never read
    part = wide[:, :200]
    assert torch.equal(row_argmax(part), part.argmax(dim=-1))


def test_other_dtypes_take_torchs_argmax() -> None:
    rows = _rows(64, seed=2).bfloat16()
    assert torch.equal(row_argmax(rows), rows.argmax(dim=-1))
