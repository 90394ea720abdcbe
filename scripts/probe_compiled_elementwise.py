#!/usr/bin/env python3
"""One layer's elementwise ops (SwiGLU's silu * up, rotary, the narrowing RMSNorm), eager against
torch.compile (inductor, dynamic shapes), at prefill, chunk and decode row counts: what a compiled
layer could save a step (docs/results/steadiness.md, set 27). SmolLM2-135M's shapes, 2 threads.

    python scripts/probe_compiled_elementwise.py [--rows 2048,192,7] [--threads 2]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

INTERMEDIATE, HEADS, HEAD_DIM, HIDDEN = 1536, 12, 64, 576  # q + k heads of SmolLM2-135M


def elementwise(gu: torch.Tensor, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, x: torch.Tensor,
                w: torch.Tensor, eps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The model's own formulas (evenflow/worker/models/layers.py, llama.py) for one layer."""
    a = F.silu(gu[:, :INTERMEDIATE]) * gu[:, INTERMEDIATE:]
    swapped = qk.view(*qk.shape[:-1], 2, HEAD_DIM // 2).flip(-2).view(qk.shape)
    rotated = torch.addcmul(qk * cos, swapped, sin).to(torch.bfloat16)
    norm = torch.hypot(torch.linalg.vector_norm(x, dim=-1, keepdim=True), eps)
    return a, rotated, torch.div(x * w, norm).to(torch.bfloat16)


def inputs(rows: int) -> tuple[torch.Tensor, ...]:
    inv = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    freqs = torch.arange(rows)[:, None].float() * inv[None]
    return (torch.randn(rows, 2 * INTERMEDIATE).bfloat16(), torch.randn(rows, HEADS, HEAD_DIM).bfloat16(),
            torch.cat((freqs.cos(), freqs.cos()), -1)[:, None], torch.cat((-freqs.sin(), freqs.sin()), -1)[:, None],
            torch.randn(rows, HIDDEN), torch.randn(HIDDEN), torch.tensor(0.1))


def best_ms(fn: Callable[..., object], args: tuple[torch.Tensor, ...], calls: int = 20) -> float:
    for _ in range(3):
        fn(*args)
    t = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    return (time.perf_counter() - t) / calls * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="2048,192,7")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    compiled = torch.compile(elementwise, dynamic=True)
    compiled(*inputs(300))
    print(f"compile (first call): {time.perf_counter() - t0:.1f} s")
    print("| rows | eager ms | compiled ms | compiled / eager | close |\n|--:|--:|--:|--:|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        a = inputs(rows)
        close = all(torch.allclose(e.float(), c.float(), atol=0.05, rtol=0.02)
                    for e, c in zip(elementwise(*a), compiled(*a)))
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        for r in range(3):  # alternating order, best of 3
            order = [("eager", elementwise), ("compiled", compiled)]
            for name, fn in order if r % 2 == 0 else order[::-1]:
                times[name].append(best_ms(fn, a))
        e, c = min(times["eager"]), min(times["compiled"])
        print(f"| {rows} | {e:.3f} | {c:.3f} | {c / e:.2f} | {close} |")


if __name__ == "__main__":
    main()
