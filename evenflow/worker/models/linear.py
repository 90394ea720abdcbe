"""Linear-layer kernels: how a weight is stored for the forward pass and multiplied.

The model calls ``kernel.prepare(weight)`` once per weight after loading and
``kernel(x, prepared, bias)`` in the forward pass, with ``x`` in ``kernel.act_dtype(prepared, rows)``
(the dtype the kernel computes in, so that the layer before writes it directly and no cast sits between
them). ``pick_linear`` chooses:

* ``TorchLinear``: ``F.linear`` on the weight as loaded (GPUs, and the fallback everywhere).
* ``PackedCpuLinear`` (float32 on CPU, and bfloat16 where the CPU has native bf16): the weight
  reordered once into oneDNN's blocked layout.
  ``F.linear`` re-packs the weight on every call from 2 rows up, which multiplies the memory
  traffic of a decode step, and a decode step is bound by weight traffic. Measured by
  ``python scripts/bench_cpu_kernels.py`` (one pass over all of the 107M "small" model's
  projections, 2-core AVX2 EPYC), packed / plain time: 8 rows 0.56 on 1 thread, 0.42 on 2;
  2 rows 0.62 / 0.36; 264 rows (compute-bound) 1.04 / 1.03. One row on one thread is 1.14 (the
  plain kernel is a GEMV there). The plain weight is released once packed, so memory does not grow.
  It sees only the row counts of ``row_tiles`` (oneDNN caches a primitive per shape).
  bfloat16 on a 2-core avx512_bf16 EPYC (576 -> 3072, 1 thread, ms): 1 row packed 0.068 / plain 0.142
  (float32 packed 0.110); 8 rows 0.151 / 0.233 (0.279); 64 rows 1.07 / 1.21 (2.28).
* ``UpcastCpuLinear`` (bf16/fp16 on a CPU without native support, e.g. AVX2): see its docstring.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from evenflow.worker.models.row_tiles import in_row_tiles

log = logging.getLogger("evenflow.worker.linear")

# Below this many rows a half-precision matmul is cheaper than upcasting its weight (measured).
UPCAST_MIN_ROWS = 8


class TorchLinear:
    """``F.linear`` on the weight as loaded."""

    name = "torch"

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        return weight

    @staticmethod
    def act_dtype(weight: torch.Tensor, rows: int) -> torch.dtype:
        return weight.dtype

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias)


class UpcastCpuLinear(TorchLinear):
    """A half-precision linear computed as float32 GEMM (exact upcasts, float32 accumulation, one
    rounding of the result: what a native bf16 GEMM does), for CPUs without native bf16/fp16,
    where this is ~4x faster than the emulated kernel from 8 rows up."""

    name = "upcast"

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[0] < UPCAST_MIN_ROWS:
            return F.linear(x, weight, bias)
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)


class PackedCpuLinear:
    """float32 linear on a weight prepacked once for oneDNN (see the module docstring)."""

    name = "onednn-packed"

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)

    @staticmethod
    def act_dtype(weight: torch.Tensor, rows: int) -> torch.dtype:
        return weight.dtype

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # oneDNN keeps a primitive per row count: bounded by row_tiles (its docstring has the measurements).
        return in_row_tiles(lambda rows: torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], ""), x)

    @classmethod
    def works(cls, dtype: torch.dtype = torch.float32) -> bool:
        """Whether this torch build has the (internal) oneDNN linear ops and they agree with
        ``F.linear`` in ``dtype``; a torch upgrade that drops or changes them falls back to
        ``TorchLinear`` instead of failing."""
        try:
            if not torch.backends.mkldnn.is_available():
                return False
            g = torch.Generator().manual_seed(0)
            w, x, b = (torch.randn(*shape, generator=g).to(dtype) for shape in ((24, 40), (5, 40), (24,)))
            kernel = cls()
            out = kernel(x, kernel.prepare(w), b)
            tol = 1e-4 if dtype == torch.float32 else 2e-2
            return out.shape == (5, 24) and torch.allclose(out.float(), F.linear(x, w, b).float(), atol=tol, rtol=tol)
        except (AttributeError, RuntimeError, TypeError) as exc:
            log.info("oneDNN packed linear unavailable (%s); using F.linear", exc)
            return False


Linear = TorchLinear | UpcastCpuLinear | PackedCpuLinear


def cpu_has_fast_path(dtype: torch.dtype) -> bool:
    """Whether CPU matmuls in ``dtype`` are native (not emulated through float32 conversions)."""
    if dtype == torch.float32:
        return True
    flags = _cpu_flags()
    if dtype == torch.bfloat16:
        return "avx512_bf16" in flags or "amx_bf16" in flags
    return "avx512_fp16" in flags or "amx_fp16" in flags


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def emulated_slowdown(dtype: torch.dtype, shape: tuple[int, int], rows: tuple[int, ...] = (1, 64)) -> list[float]:
    """``dtype``'s linear time over float32's (packed where it can be) at each row count, measured on
    one weight of ``shape``: what a CPU without native ``dtype`` costs (min of 5, one thread)."""
    import time

    half, full = UpcastCpuLinear(), PackedCpuLinear() if PackedCpuLinear.works() else TorchLinear()
    w = torch.randn(*shape) * 0.02
    wh, wf = half.prepare(w.to(dtype)), full.prepare(w)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ratios = []
    try:
        for n in rows:
            x = torch.randn(n, shape[1])
            best = []
            for fn in (lambda: half(x.to(dtype), wh), lambda: full(x, wf)):
                fn()
                times = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t0)
                best.append(min(times))
            ratios.append(best[0] / best[1])
    finally:
        torch.set_num_threads(threads)
    return ratios


def pick_linear(dtype: torch.dtype, device: torch.device, packed: bool = True) -> Linear:
    """The linear kernel for ``dtype`` on ``device`` (``packed=False`` refuses the packed one)."""
    if device.type != "cpu":
        return TorchLinear()
    if not cpu_has_fast_path(dtype):
        return UpcastCpuLinear()
    if dtype in (torch.float32, torch.bfloat16) and packed and PackedCpuLinear.works(dtype):
        return PackedCpuLinear()
    return TorchLinear()
