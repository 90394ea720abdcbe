"""evenflow's int4 GEMV (models/int4_gemv.py): the float32 product of the dequantized weight (with x as the AVX2
path rounds it to 8 bits), rounded once to bfloat16, on its VDPBF16PS path and (from 3 rows, where the CPU has
AMX) its AMX one, in one A tile of rows and in several, or on its AVX2 path (either tile height); the same bits
on any thread count; taken by ``Int4CpuLinear`` for the rows its plan gives it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from evenflow.worker.cpp_kernels import load_cpp_sources
from evenflow.worker.models.int4_gemv import (
    NO_GEMV, SOURCES, GemvRows, Int4Gemv, _bind, gemv_rows, load_int4_gemv, strip_order,
)
from evenflow.worker.models.int4_linear import _INT4_MM, EVERY_ROW, Int4CpuLinear, Int4Plan, measure_int4_plan
from evenflow.worker.models.linear import TorchLinear
from evenflow.worker.models.q4_blocks import GROUP, Int4Weight, Q4Rows, pack


@pytest.fixture(scope="module")
def gemv() -> Int4Gemv:
    kernel = load_int4_gemv()
    if kernel is None:
        pytest.skip("evenflow's int4 GEMV does not run here (no AVX-512 BF16 or VBMI, or no compiler)")
    return kernel


def _weight(n: int, k: int, seed: int) -> tuple[Int4Weight, torch.Tensor]:
    """A 4-bit weight with scales and zeros of both signs, and its values in float64."""
    g = torch.Generator().manual_seed(seed)
    weight = pack(Q4Rows(torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g),
                         torch.rand(n, k // GROUP, generator=g) * 0.05, torch.randn(n, k // GROUP, generator=g) * 0.05))
    return weight, weight.dequantize(torch.empty(n, k)).double()


def _as_the_kernel_reads(x: torch.Tensor, isa: str) -> torch.Tensor:
    """``x`` (bfloat16) in float64 as the kernel multiplies it: on the AVX2 path rounded to 8 bits with a scale per
    16 columns, the even and the odd ones of each group of 32 (xs = their largest |x| / 127, xq = x * (127 /
    largest) to nearest even, in float32 as there)."""
    if isa != "AVX2":
        return x.double()
    halves = x.float().view(*x.shape[:-1], -1, GROUP // 2, 2)  # [..., group, column pair, parity]
    most = halves.abs().amax(-2, keepdim=True)
    inverse = torch.full_like(most, 127.0).div(most)  # 127 / most divides (a tensor's __rtruediv__ takes a reciprocal)
    xq = torch.round(halves * torch.where(most > 0, inverse, 0))
    return (xq.double() * (most / 127).double()).view(x.shape)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 16, 21])
@pytest.mark.parametrize("shape", [(64, 32), (128, 576), (960, 576), (576, 1536)])
def test_products_are_the_float32_products_rounded_to_bfloat16(gemv: Int4Gemv, shape: tuple[int, int],
                                                                rows: int) -> None:
    n, k = shape
    weight, values = _weight(n, k, seed=n + k + rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    exact = _as_the_kernel_reads(x, gemv.isa) @ values.T
    got = gemv(x, weight)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    # bfloat16's rounding (2^-9 of the value, twice for slack) and float32's sums (a small share of the terms' size)
    bound = exact.abs() * 2**-8 + 1e-5 * (x.double().abs() @ values.abs().T)
    assert ((got.double() - exact).abs() <= bound).all()
    # torch's kernel computes the product of x itself, to the last bit or so
    exact = x.double() @ values.T
    torch_int4 = _INT4_MM(x, weight.packed, GROUP, weight.scale_zeros).double()
    assert ((torch_int4 - exact).abs() <= exact.abs() * 2**-8 + 1e-5 * (x.double().abs() @ values.abs().T)).all()


@pytest.mark.parametrize("tile_rows", [32, 64])
@pytest.mark.parametrize("rows", [1, 2, 3, 5])
def test_both_tile_heights_torch_packs_are_read(tile_rows: int, rows: int) -> None:
    """Weights laid out by hand in torch's AVX2 (32-row) and AVX-512 (64-row) tiles give the product on whichever
    path takes that height here (AVX2's takes both): each path is checked where torch packs the other height."""
    lib = load_cpp_sources(SOURCES, "a test of the int4 GEMV", _bind)
    if lib is None or not lib.evenflow_int4_gemv_isa(tile_rows):
        pytest.skip(f"no path of the int4 GEMV reads {tile_rows}-row tiles on this CPU")
    n, k = 192, 576
    g = torch.Generator().manual_seed(tile_rows + rows)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scale, zero = torch.rand(n, k // GROUP, generator=g) * 0.05, torch.randn(n, k // GROUP, generator=g) * 0.05
    weight = pack(Q4Rows(q, scale, zero))
    halves = q.view(n // tile_rows, 2, tile_rows // 2, k)  # byte (tile, kk, d): rows tile*T + d and tile*T + T/2 + d
    by_hand = replace(weight, packed=(halves[:, 0] | halves[:, 1] << 4).transpose(1, 2).contiguous())
    x = torch.randn(rows, k, generator=g).bfloat16()
    values = weight.dequantize(torch.empty(n, k)).double()
    gemv = Int4Gemv(lib, tile_rows)
    exact = _as_the_kernel_reads(x, gemv.isa) @ values.T
    got = gemv(x, by_hand).double()
    assert ((got - exact).abs() <= exact.abs() * 2**-8 + 1e-5 * (x.double().abs() @ values.abs().T)).all()
    if gemv.isa == "AVX2":  # every row sums in one order, alone or in a block of rows
        assert torch.equal(gemv(x[-1:], by_hand), gemv(x, by_hand)[-1:])
        # the scales in the kernel's strip order give the same bits as torch's order
        laid = replace(by_hand, strip_scales=strip_order(weight.scale_zeros, tile_rows))
        assert torch.equal(gemv(x, laid), gemv(x, by_hand))


def test_non_finite_inputs_give_non_finite_outputs(gemv: Int4Gemv) -> None:
    """A NaN or an infinity in a row of x (a model gone wrong) reaches that row's outputs, as a float product
    would carry it, and leaves the other rows alone."""
    weight, _ = _weight(128, 576, seed=8)
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(9)).bfloat16()
    x[0, 40], x[1, 300] = float("nan"), float("inf")
    y = gemv(x[:2], weight).float()  # two rows: the vector path on every CPU (AMX takes three or more)
    assert y[0].isnan().all() and not y[1].isfinite().any()
    assert gemv(x[::2], weight).float()[1].isfinite().all()


@pytest.mark.parametrize("rows", [1, 5])
def test_the_bits_do_not_depend_on_the_thread_count(gemv: Int4Gemv, rows: int) -> None:
    weight, _ = _weight(960, 576, seed=3)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(4)).bfloat16()
    prior = torch.get_num_threads()
    try:
        products = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            products.append(gemv(x, weight))
    finally:
        torch.set_num_threads(prior)
    assert all(torch.equal(products[0], p) for p in products[1:])


def test_the_linear_takes_it_for_the_rows_its_plan_gives_it(gemv: Int4Gemv) -> None:
    weight, _ = _weight(128, 576, seed=5)
    linear = Int4CpuLinear(TorchLinear(), Int4Plan(8, torch.bfloat16, "test", gemv_rows=GemvRows(2, 4)))
    assert [linear.kernel(rows) for rows in (1, 2, 4, 5, 8, 9)] == ["int4", "gemv", "gemv", "int4", "int4", "dense"]
    x = torch.randn(8, 576, generator=torch.Generator().manual_seed(6)).bfloat16()
    assert torch.equal(linear(x[:3], weight), gemv(x[:3], weight))
    assert torch.equal(linear(x[:6], weight), _INT4_MM(x[:6], weight.packed, GROUP, weight.scale_zeros))
    assert torch.equal(linear(x[:1], weight), _INT4_MM(x[:1], weight.packed, GROUP, weight.scale_zeros))
    # float32 rows are cast to bfloat16 for it and back
    assert torch.equal(linear(x[:2].float(), weight), gemv(x[:2], weight).float())


def test_a_linear_that_runs_it_lays_out_the_scales_for_it(gemv: Int4Gemv) -> None:
    """The AVX2 kernel's weights carry their scales in its strip order (the same products); the AVX-512 one's
    and those of a plan that gives the GEMV no rows carry torch's alone."""
    weight, _ = _weight(192, 576, seed=11)
    runs = Int4CpuLinear(TorchLinear(), Int4Plan(8, torch.bfloat16, "test", gemv_rows=GemvRows(1, 4)))
    laid = runs.laid_out(weight)
    assert (laid.strip_scales is not None) == (gemv.isa == "AVX2")
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(12)).bfloat16()
    assert torch.equal(runs(x, laid), gemv(x, weight))
    never = Int4CpuLinear(TorchLinear(), Int4Plan(8, torch.bfloat16, "test"))
    assert never.laid_out(weight) is weight


def test_it_takes_the_longest_run_of_probes_it_won() -> None:
    won, lost = (2.0, 1.0), (1.0, 2.0)  # (torch's seconds, the GEMV's)
    assert gemv_rows({1: won, 2: won, 4: lost, 8: won}) == GemvRows(1, 2)  # a win alone is not taken
    assert gemv_rows({4: won, 1: won, 2: won}) == GemvRows(1, 4)  # by row count, not by the order measured
    # from the count after the probe it lost: 3 rows, between a loss at 2 and a win at 4, are its
    assert gemv_rows({1: lost, 2: lost, 4: won, 8: won, 16: lost}) == GemvRows(3, 8)
    assert gemv_rows({1: won, 2: lost, 4: won, 8: won}) == GemvRows(3, 8)  # the longer run
    assert gemv_rows({1: lost}) == NO_GEMV and gemv_rows({}) == NO_GEMV
    assert gemv_rows({1: (1.0, 1.0)}) == NO_GEMV  # a tie keeps torch's kernel


def test_the_plan_gives_it_the_measured_rows_and_counts_its_time_there(gemv: Int4Gemv) -> None:
    plan = measure_int4_plan((960, 576), bf16_fast=True)
    first, last = plan.gemv_rows
    assert "GEMV" in plan.reason and last <= plan.max_int4_rows
    if plan.every_row:  # it won past the largest probe too: every row count from its first
        assert f"int4 at every row count (evenflow's GEMV from {first} row" in plan.reason and last == EVERY_ROW
    else:
        assert (f"(evenflow's GEMV for {first}-{last})" in plan.reason) == (first <= last)
    without = Int4CpuLinear(TorchLinear(), Int4Plan(8, torch.bfloat16, "test"))
    assert without.kernel(1) == "int4"  # a plan that never measured it never takes it


def test_no_rows_give_no_products(gemv: Int4Gemv) -> None:
    weight, _ = _weight(128, 64, seed=7)
    assert gemv(torch.empty(0, 64, dtype=torch.bfloat16), weight).shape == (0, 128)
    linear = Int4CpuLinear(TorchLinear(), Int4Plan(8, torch.bfloat16, "test", gemv_rows=GemvRows(1, 4)))
    assert linear.kernel(0) == "int4"
