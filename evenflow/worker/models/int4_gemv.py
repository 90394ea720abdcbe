"""evenflow's own product of a few rows with a 4-bit weight, on CPUs with AVX-512 BF16 and VBMI.

A decode step of one row is a GEMV per projection, bound by the bytes of the weight. Torch's int4 kernel
(``_weight_int4pack_mm_for_cpu``) turns each 4-bit value into a float32 number and multiplies it, and on a
2-core Xeon with AMX it read SmolLM2's projections at 10-13.5 GB/s of the 26.7 the machine reads
(docs/results/quantization.md). int4_gemv.cpp reads torch's own packed tiles and scales (no second copy of
the weight) and makes each value a bfloat16 number by two bit operations, so one VDPBF16PS multiplies 32
values: the same bfloat16 activations, float32 sums, a bfloat16 result.

Its sums run in another order than torch's, so its bits differ from torch's in the last place of some
outputs; the Python layer loop and the fused one (models/fused_decode.py) call the same kernel for the same
rows, and give the same bits. It runs for the projections' rows up to the int4 plan's ``max_gemv_rows``
and the LM head's 4-bit screen's up to its ``gemv_rows`` (each measured against torch's kernel at start-up
by ``gemv_rows``: models/int4_linear.py, models/lm_head.py), where the CPU has the instructions, torch packs
64-row tiles, the library builds, and it agrees with torch's kernel on a probe weight.
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache
from pathlib import Path

import torch
from evenflow.worker.cpp_kernels import load_cpp
from evenflow.worker.models.q4_blocks import GROUP, Int4Weight, Q4Rows, pack, pack_tile_rows

log = logging.getLogger("evenflow.worker.int4")

SOURCE = Path(__file__).with_name("int4_gemv.cpp")
# Torch's int4 kernel, the overload itself (calling it skips the overload resolution of torch.ops.aten.<name>);
# None in a torch without it.
TORCH_INT4_MM = getattr(getattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", None), "default", None)
_TILE_ROWS = 64  # the AVX-512 packing's tile, the only one the kernel reads


def _bind(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.evenflow_int4_gemv.restype = ctypes.c_int
    lib.evenflow_int4_gemv.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, ctypes.c_int]
    lib.evenflow_int4_gemv_supported.restype = ctypes.c_int


class Int4Gemv:
    """``__call__(x, weight)``: ``x`` [rows, in] bfloat16 @ ``weight``.T -> [rows, out] bfloat16."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._gemv = lib.evenflow_int4_gemv

    def __call__(self, x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
        assert x.dtype == torch.bfloat16 and x.shape[1] == weight.in_features
        x = x.contiguous()
        y = torch.empty(x.shape[0], weight.out_features, dtype=torch.bfloat16)
        rc = self._gemv(x.data_ptr(), x.shape[0], weight.in_features, weight.packed.data_ptr(),
                        weight.scale_zeros.data_ptr(), weight.out_features, y.data_ptr(), torch.get_num_threads())
        if rc:
            raise RuntimeError(f"int4 GEMV refused a {weight.out_features}x{weight.in_features} weight")
        return y


def takes_gemv(rows: int, gemv_rows: int) -> bool:
    """Whether a product of ``rows`` rows runs on evenflow's GEMV, given the ``gemv_rows`` a start-up timing
    gave it (``gemv_rows``): the one rule the projections, the fused loop and the head's screen share."""
    return 0 < rows <= gemv_rows and load_int4_gemv() is not None


def int4_product(x: torch.Tensor, weight: Int4Weight, gemv_rows: int) -> torch.Tensor:
    """``x`` (bfloat16) @ ``weight``.T in bfloat16: evenflow's GEMV where ``takes_gemv``, else torch's kernel."""
    if takes_gemv(x.shape[0], gemv_rows):
        return load_int4_gemv()(x, weight)  # type: ignore[misc]  (takes_gemv saw it load)
    return TORCH_INT4_MM(x, weight.packed, GROUP, weight.scale_zeros)


def _agrees(gemv: Int4Gemv) -> bool:
    """Whether the kernel's products match torch's int4 kernel's on a probe weight, to bfloat16's rounding
    (a layout it misreads gives values of another row, far outside that)."""
    g = torch.Generator().manual_seed(0)
    n, k = 2 * _TILE_ROWS, 4 * GROUP
    weight = pack(Q4Rows(torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g),
                         torch.rand(n, k // GROUP, generator=g) * 0.1, torch.randn(n, k // GROUP, generator=g) * 0.1))
    x = torch.randn(5, k, generator=g).bfloat16()
    want = TORCH_INT4_MM(x, weight.packed, GROUP, weight.scale_zeros).float()
    got = gemv(x, weight).float()
    return bool(torch.allclose(got, want, rtol=2 ** -6, atol=1e-3))


def gemv_rows(timings: dict[int, tuple[float, float]]) -> int:
    """The most rows evenflow's GEMV takes, from (torch's int4 kernel, the GEMV) seconds at each probe row
    count: the largest count of the run of probes, from the first, at which the GEMV was faster (0: it lost
    at the first). A count between two probes it won goes to it; from the first it lost on, torch's kernel
    takes every count, a later win being the noise of one trial more likely than a kernel that wins again."""
    best = 0
    for rows in sorted(timings):
        torch_s, gemv_s = timings[rows]
        if gemv_s >= torch_s:
            break
        best = rows
    return best


@cache
def load_int4_gemv() -> Int4Gemv | None:
    """The kernel, once per process; None where it cannot run here (the reason logged)."""
    if pack_tile_rows() != _TILE_ROWS:
        log.info("int4 GEMV off: torch packs int4 in %s-row tiles here, the kernel reads %d", pack_tile_rows(),
                 _TILE_ROWS)
        return None
    lib = load_cpp(SOURCE, "few-row products with 4-bit weights", _bind)
    if lib is None:
        return None
    if not lib.evenflow_int4_gemv_supported():
        log.info("int4 GEMV off: the CPU lacks AVX-512 BF16 or VBMI")
        return None
    gemv = Int4Gemv(lib)
    if not _agrees(gemv):
        log.warning("int4 GEMV off: its products disagree with torch's int4 kernel on a probe")
        return None
    return gemv
