"""evenflow's own product of a few rows with a 4-bit weight, on CPUs with AVX-512 BF16 and VBMI (and AMX) or AVX2.

A decode step of one row is a GEMV per projection, bound by the bytes of the weight. Torch's int4 kernel
(``_weight_int4pack_mm_for_cpu``) turns each 4-bit value into a float32 number and multiplies it, and on a
2-core Xeon with AMX it read SmolLM2's projections at 10-13.5 GB/s of the 26.7 the machine reads
(docs/results/quantization.md). int4_gemv.cpp reads torch's own packed tiles and scales (no second copy of
the weight) and makes each value a bfloat16 number by two bit operations, so one VDPBF16PS multiplies 32
values: the same bfloat16 activations, float32 sums, a bfloat16 result. Torch's kernel's time also grows
with the rows (6 rows cost 2-3x one row); from 3 rows on, where the CPU has AMX, the same unpacked values
are AMX tiles, and 16 rows cost about what 2 do (0.23-0.35x torch's kernel at 16 rows). On CPUs without
AVX-512 BF16 (AVX2), int4_gemv_avx2.cpp reads torch's 32-row tiles (or 64-row ones) once for up to two rows of x,
with x rounded to 8-bit integers as llama.cpp rounds it for its Q4 products but with a scale per 16 columns (2^-8
of their largest value) and the products summed exactly by VPMADDUBSW, two columns and 16 rows an instruction:
on a 2-core AVX2 EPYC SmolLM2's projections took 0.90-0.94x the time of the 16-bit rounding's VPMADDWD (itself
0.81-0.83x a one-row step's float32 FMAs, themselves 0.38-0.47x torch's kernel's time).
That kernel reads the scales and zeros from a copy in its own order (``gemv_layout``), each 32-row strip's in one
run of memory: in torch's order a strip's groups are a row of the weight apart.

Its sums run in another order than torch's, so its bits differ from torch's in the last place of some
outputs; the Python layer loop and the fused one (models/fused_decode.py) call the same kernel for the same
rows, and give the same bits. It runs for the projections' row counts in the int4 plan's ``gemv_rows`` and
the LM head's 4-bit screen's in its ``gemv_rows`` (each measured against torch's kernel at start-up by
``gemv_rows``: models/int4_linear.py, models/lm_head.py), where the CPU has the instructions for the tiles
torch packs, the library builds, and it agrees with torch's kernel on a probe weight at one row and at five.
"""
from __future__ import annotations

import ctypes
import logging
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import NamedTuple

import torch
from evenflow.worker.cpp_kernels import AMX_TILES_SOURCE, load_cpp_sources
from evenflow.worker.models.q4_blocks import GROUP, Int4Weight, Q4Rows, pack, pack_tile_rows

log = logging.getLogger("evenflow.worker.int4")

SOURCES = [AMX_TILES_SOURCE, Path(__file__).with_name("int4_gemv_avx2.cpp"), Path(__file__).with_name("int4_gemv.cpp")]
# Torch's int4 kernel, the overload itself (calling it skips the overload resolution of torch.ops.aten.<name>);
# None in a torch without it.
TORCH_INT4_MM = getattr(getattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", None), "default", None)
_PROBE_ROWS = 64  # the probe weight's rows: a multiple of every tile height torch packs


def _bind(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.evenflow_int4_gemv.restype = ctypes.c_int
    lib.evenflow_int4_gemv.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ctypes.c_int, i64]
    lib.evenflow_int4_gemv_isa.restype = ctypes.c_int
    lib.evenflow_int4_gemv_isa.argtypes = [i64]
    lib.evenflow_int4_amx_from_rows.restype = ctypes.c_int


class Int4Gemv:
    """``__call__(x, weight)``: ``x`` [rows, in] bfloat16 @ ``weight``.T -> [rows, out] bfloat16."""

    def __init__(self, lib: ctypes.CDLL, tile_rows: int) -> None:
        self._gemv = lib.evenflow_int4_gemv
        self.tile_rows = tile_rows  # torch's int4 tile height here (q4_blocks.pack_tile_rows)
        self.isa = "AVX-512 BF16" if lib.evenflow_int4_gemv_isa(tile_rows) == 2 else "AVX2"
        # 0: no AMX here, the vector instructions for every row count
        self.amx_from_rows = lib.evenflow_int4_amx_from_rows() if self.isa != "AVX2" else 0

    def __call__(self, x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
        assert x.dtype == torch.bfloat16 and x.shape[1] == weight.in_features
        x = x.contiguous()
        y = torch.empty(x.shape[0], weight.out_features, dtype=torch.bfloat16)
        strip = weight.strip_scales
        rc = self._gemv(x.data_ptr(), x.shape[0], weight.in_features, weight.packed.data_ptr(),
                        weight.scale_zeros.data_ptr(), None if strip is None else strip.data_ptr(),
                        weight.out_features, y.data_ptr(), torch.get_num_threads(), self.tile_rows)
        if rc:
            raise RuntimeError(f"int4 GEMV refused a {weight.out_features}x{weight.in_features} weight")
        return y


def strip_order(scale_zeros: torch.Tensor, tile_rows: int) -> torch.Tensor:
    """``scale_zeros`` [k / 32, n, 2] in the AVX2 kernel's strip order, [n / 32, k / 32, 32, 2]: strip i is rows
    t*T + 16s + [0, 16) and t*T + T/2 + 16s + [0, 16) of tile t = i // (T / 32), s = i % (T / 32), in the order
    of its four accumulators' runs of eight rows (int4_gemv_avx2.cpp's ``gemv_strip``)."""
    groups, n, _ = scale_zeros.shape
    strips = tile_rows // 32
    # rows [tile][strip][half][16]: half 0 the low nibbles' rows, 1 the high nibbles' (T/2 further on)
    order = torch.arange(n).view(n // tile_rows, 2, strips, 16).transpose(1, 2).reshape(-1)
    return scale_zeros.index_select(1, order).view(groups, n // 32, 32, 2).transpose(0, 1).contiguous()


def gemv_layout(weight: Int4Weight) -> Int4Weight:
    """``weight`` with the scales and zeros in the order the GEMV reads them fastest here: its strip-order copy
    where the AVX2 kernel runs (``strip_order``), itself elsewhere."""
    gemv = load_int4_gemv()
    if gemv is None or gemv.isa != "AVX2" or weight.strip_scales is not None:
        return weight
    return replace(weight, strip_scales=strip_order(weight.scale_zeros, gemv.tile_rows))


class GemvRows(NamedTuple):
    """The row counts a start-up timing gave evenflow's GEMV: ``first`` to ``last`` (none where last < first)."""

    first: int = 1
    last: int = 0


NO_GEMV = GemvRows()


def takes_gemv(rows: int, gemv_rows: GemvRows) -> bool:
    """Whether a product of ``rows`` rows runs on evenflow's GEMV, given the ``gemv_rows`` a start-up timing
    gave it (``gemv_rows``): the one rule the projections, the fused loop and the head's screen share."""
    return gemv_rows.first <= rows <= gemv_rows.last and load_int4_gemv() is not None


def int4_product(x: torch.Tensor, weight: Int4Weight, gemv_rows: GemvRows) -> torch.Tensor:
    """``x`` (bfloat16) @ ``weight``.T in bfloat16: evenflow's GEMV where ``takes_gemv``, else torch's kernel."""
    if takes_gemv(x.shape[0], gemv_rows):
        return load_int4_gemv()(x, weight)  # type: ignore[misc]  (takes_gemv saw it load)
    return TORCH_INT4_MM(x, weight.packed, GROUP, weight.scale_zeros)


def _agrees(gemv: Int4Gemv) -> bool:
    """Whether the kernel's products match torch's int4 kernel's on a probe weight, to a small share of each row's
    largest (a layout it misreads gives values of another row, far outside that), at one row and at five (the
    VDPBF16PS path and, where the CPU has it, AMX's)."""
    g = torch.Generator().manual_seed(0)
    n, k = 2 * _PROBE_ROWS, 4 * GROUP
    weight = pack(Q4Rows(torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g),
                         torch.rand(n, k // GROUP, generator=g) * 0.1, torch.randn(n, k // GROUP, generator=g) * 0.1))
    x = torch.randn(5, k, generator=g).bfloat16()
    want = TORCH_INT4_MM(x, weight.packed, GROUP, weight.scale_zeros).float()
    got = torch.cat([gemv(x[:1], weight), gemv(x, weight)[1:]]).float()
    # within 2^-6 of each row's largest product: the AVX2 path's 8-bit x is off by ~2^-10 of it
    return bool(((got - want).abs() <= 2 ** -6 * want.abs().amax(-1, keepdim=True)).all())


def gemv_rows(timings: dict[int, tuple[float, float]]) -> GemvRows:
    """The row counts evenflow's GEMV takes, from (torch's int4 kernel, the GEMV) seconds at each probe row
    count: the longest run of probes at which the GEMV was faster (the later of two as long), from the count
    after the probe before the run (or 1) to the run's last probe (NO_GEMV: it won none). Its lead grows with
    the rows (AMX from 3), while at a row or two a cache-warm probe can favour torch's kernel; a win alone
    among losses is more likely one trial's noise than a kernel that wins again: one run, not every win."""
    best, best_probes = NO_GEMV, 0
    first, probes, previous = 0, 0, 0
    for rows in sorted(timings):
        torch_s, gemv_s = timings[rows]
        if gemv_s < torch_s:
            first, probes = first or previous + 1, probes + 1
            if probes >= best_probes:
                best, best_probes = GemvRows(first, rows), probes
        else:
            first, probes = 0, 0
        previous = rows
    return best


@cache
def load_int4_gemv() -> Int4Gemv | None:
    """The kernel, once per process; None where it cannot run here (the reason logged)."""
    tile_rows = pack_tile_rows()
    if tile_rows is None:
        log.info("int4 GEMV off: torch's int4 packing here is not a layout evenflow reads")
        return None
    lib = load_cpp_sources(SOURCES, "few-row products with 4-bit weights", _bind)
    if lib is None:
        return None
    if not lib.evenflow_int4_gemv_isa(tile_rows):
        log.info("int4 GEMV off: the CPU has neither AVX-512 BF16 and VBMI nor AVX2 and FMA for %d-row tiles",
                 tile_rows)
        return None
    gemv = Int4Gemv(lib, tile_rows)
    if not _agrees(gemv):
        log.warning("int4 GEMV off: its products disagree with torch's int4 kernel on a probe")
        return None
    log.info("int4 GEMV on: %s%s", gemv.isa, f", AMX from {gemv.amx_from_rows} rows" if gemv.amx_from_rows else
             " for every row count (no AMX here)")
    return gemv
