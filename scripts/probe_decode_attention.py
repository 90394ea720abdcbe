#!/usr/bin/env python3
"""Decode attention on a bfloat16 paged cache on CPU: the C++ kernel (evenflow/worker/attention/cpu_decode.py)
against PyTorch's attention as TorchPagedAttention runs it without the kernel (each group's blocks
gathered, or a lone request's read in place, then SDPA), two ways:

* one layer's attention (``plan`` once, then ``forward``: the K/V write and the attention), B requests of
  L tokens each, their blocks one range of ids as a served stream's are; "hot" repeats the call, "cold"
  evicts the caches first (a step's other layers' weights and K/V pass through between a layer's calls);
* ``--model``: whole B=1..8 decode steps of that model in process (evenflow/bench/roofline.py's split).

The variants alternate order over ``--rounds``; the best round is kept. SmolLM2-135M's heads by default
(9 query heads over 3 KV heads, head_dim 64). Results: docs/results/quantization.md.

    python scripts/probe_decode_attention.py [--batch 1,6,8,32] [--context 128,256,1024,2048] [--threads 2]
    python scripts/probe_decode_attention.py --model SmolLM2-135M-Instruct.Q4_1.gguf --batch 1,6,8 --context 256
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch

from evenflow.worker.attention.base import AttentionInputs
from evenflow.worker.attention.torch_paged import TorchPagedAttention
from evenflow.worker.synthetic_steps import synthetic_step

BLOCK = 16
_FLUSH = torch.zeros(0, dtype=torch.uint8)


def _seconds(fn: Callable[[], object], calls: int, cold: bool) -> float:
    """Median seconds of a call (each after evicting the caches when ``cold``)."""
    times = []
    for _ in range(calls + 3):
        if cold:
            _FLUSH.add_(1)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times[3:]))


def decode_inputs(batch: int, context: int) -> AttentionInputs:
    """``batch`` decodes of ``context`` tokens (the new one's included), each on a range of block ids."""
    return synthetic_step([1] * batch, [context] * batch, BLOCK, torch.device("cpu")).attn


def layer_table(args: argparse.Namespace) -> None:
    heads, kv_heads, head_dim = (int(x) for x in args.heads.split(","))
    dt = torch.bfloat16
    backend = TorchPagedAttention(heads, kv_heads, head_dim, head_dim**-0.5, dt)
    if not backend.decode_kernel.available:
        raise SystemExit("the C++ decode kernel did not build here")
    kernel_fn = backend.decode_kernel._fn
    print(f"| B | context | PyTorch hot us | kernel hot us | kernel / PyTorch | PyTorch cold us | kernel cold us | "
          f"kernel / PyTorch |\n|--:|--:|--:|--:|--:|--:|--:|--:|")
    for batch in (int(b) for b in args.batch.split(",")):
        for context in (int(c) for c in args.context.split(",")):
            inputs = decode_inputs(batch, context)
            blocks = batch * -(-context // BLOCK)
            caches = (torch.randn(blocks, BLOCK, kv_heads, head_dim).to(dt),
                      torch.randn(blocks, BLOCK, kv_heads, head_dim).to(dt))
            q = torch.randn(batch, heads + 2 * kv_heads, head_dim).to(dt)
            k, v = q[:, heads : heads + kv_heads], q[:, heads + kv_heads :]
            best: dict[tuple[bool, bool], float] = {}
            for r in range(args.rounds):
                for kernel in (False, True) if r % 2 == 0 else (True, False):
                    backend.decode_kernel._fn = kernel_fn if kernel else None
                    plan = backend.plan(inputs)
                    for cold in (False, True):
                        s = _seconds(lambda: backend.forward(q[:, :heads], k, v, caches, plan), args.calls, cold)
                        best[(kernel, cold)] = min(best.get((kernel, cold), s), s)
            ph, kh, pc, kc = (best[(False, False)], best[(True, False)], best[(False, True)], best[(True, True)])
            print(f"| {batch} | {context} | {ph * 1e6:.0f} | {kh * 1e6:.0f} | {kh / ph:.2f} | {pc * 1e6:.0f} | "
                  f"{kc * 1e6:.0f} | {kc / pc:.2f} |")
    backend.decode_kernel._fn = kernel_fn


def step_table(args: argparse.Namespace) -> None:
    from evenflow.bench.decode_latency import runner_for
    from evenflow.bench.roofline import profile_decode

    context = int(args.context.split(",")[0])
    runner = runner_for(args.model, "int4", context, args.threads)
    kernel = runner.attn.decode_kernel
    kernel_fn = kernel._fn
    if kernel_fn is None:
        raise SystemExit("the model's decodes do not take the kernel here (no bfloat16 cache, or no build)")
    best: dict[tuple[bool, int], tuple[float, float]] = {}
    for r in range(args.rounds):
        for on in (False, True) if r % 2 == 0 else (True, False):
            kernel._fn = kernel_fn if on else None
            for batch in (int(b) for b in args.batch.split(",")):
                s = profile_decode(runner, batch, context, args.calls)
                # The wrapped step's total: the one its attention time is of (the fused layer loop is off there).
                if (on, batch) not in best or s.split_total_s < best[(on, batch)][0]:
                    best[(on, batch)] = (s.split_total_s, s.attention_s)
    kernel._fn = kernel_fn
    print(f"context {context}, {args.threads} threads, best of {args.rounds} rounds (median of {args.calls} steps)")
    print("| B | step PyTorch ms | step kernel ms | kernel / PyTorch | attention PyTorch ms | attention kernel ms |\n"
          "|--:|--:|--:|--:|--:|--:|")
    for batch in (int(b) for b in args.batch.split(",")):
        (p, pa), (k, ka) = best[(False, batch)], best[(True, batch)]
        print(f"| {batch} | {p * 1e3:.2f} | {k * 1e3:.2f} | {k / p:.2f} | {pa * 1e3:.2f} | {ka * 1e3:.2f} |")


def main() -> None:
    global _FLUSH
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="a GGUF served with int4 projections: whole decode steps")
    p.add_argument("--batch", default="1,6,8,32")
    p.add_argument("--context", default="128,256,1024,2048")
    p.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head_dim (without --model)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--flush-mb", type=int, default=64, help="bytes written between cold calls")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    _FLUSH = torch.zeros(args.flush_mb << 20, dtype=torch.uint8)
    with torch.inference_mode():
        step_table(args) if args.model else layer_table(args)


if __name__ == "__main__":
    main()
