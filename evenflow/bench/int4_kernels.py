"""The linear kernels a decode or prefill step can use, timed side by side on one weight shape:
float32 (oneDNN-packed), bfloat16 (oneDNN-packed where native), torch's int4 kernel and evenflow's int4
GEMV (models/int4_gemv.py; AMX from 3 rows where the CPU has it) on GGUF Q4 blocks (bfloat16
activations), with the dequantize-then-bf16 path int4 switches to for many rows. One weight, called
again and again: the cache holds it (a step reads its weights from memory: bench_roofline's steps)."""

from __future__ import annotations


import torch
from evenflow.worker.models.int4_gemv import GemvRows, load_int4_gemv
from evenflow.worker.models.int4_linear import Int4CpuLinear, Int4Plan
from evenflow.worker.models.kernel_timing import time_min
from evenflow.worker.models.linear import PackedCpuLinear, TorchLinear
from evenflow.worker.models.q4_blocks import GROUP, Q4Rows, pack

SHAPES = [(1, 576, 960), (1, 576, 576), (1, 576, 3072), (1, 1536, 576), (1, 576, 49152),
          (6, 576, 3072), (16, 576, 3072), (64, 576, 3072), (256, 576, 3072), (8, 1024, 8192), (8, 4096, 4096),
          (64, 1024, 8192)]
KERNELS = ["float32", "bfloat16", "int4", "int4 evenflow", "int4 dequant+bf16"]


def time_kernels(rows: int, k: int, n: int, trials: int = 7) -> list[float]:
    """Milliseconds per call of each of ``KERNELS`` (min over trials, kernels interleaved in each; NaN for
    evenflow's GEMV where it does not run)."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(n, k, generator=g) * 0.02, torch.randn(rows, k, generator=g)
    f32 = PackedCpuLinear() if PackedCpuLinear.works() else TorchLinear()
    bf16 = PackedCpuLinear() if PackedCpuLinear.works(torch.bfloat16) else TorchLinear()
    wf, wb, xb = f32.prepare(w), bf16.prepare(w.bfloat16()), x.bfloat16()
    q4 = pack(Q4Rows(torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g),
                     torch.rand(n, k // GROUP, generator=g) * 0.01, torch.zeros(n, k // GROUP)))
    int4 = Int4CpuLinear(f32, Int4Plan(1 << 30, torch.bfloat16, "all rows int4"))
    gemv = Int4CpuLinear(f32, Int4Plan(1 << 30, torch.bfloat16, "all rows GEMV", gemv_rows=GemvRows(1, 1 << 30)))
    dense = Int4CpuLinear(f32, Int4Plan(0, torch.bfloat16, "all rows dense"))
    fns = [lambda: f32(x, wf), lambda: bf16(xb, wb), lambda: int4(x, q4), lambda: gemv(x, q4), lambda: dense(x, q4)]
    has_gemv = load_int4_gemv() is not None
    with torch.inference_mode():
        best = time_min(fns if has_gemv else fns[:3] + fns[4:], trials)
    if not has_gemv:
        best.insert(3, float("nan"))
    return [b * 1e3 for b in best]


def kernel_table(shapes: list[tuple[int, int, int]] = SHAPES) -> str:
    lines = ["| rows x in -> out | " + " | ".join(KERNELS) + " |", "|---|" + "--:|" * len(KERNELS)]
    for rows, k, n in shapes:
        lines.append(f"| {rows} x {k} -> {n} | " + " | ".join(f"{t:.3f}" for t in time_kernels(rows, k, n)) + " |")
    return "\n".join(lines)
