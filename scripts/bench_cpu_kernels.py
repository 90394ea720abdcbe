#!/usr/bin/env python3
"""The two CPU kernel choices behind the worker's step time, measured in isolation.

    python scripts/bench_cpu_kernels.py                      # both tables, 1 and 2 threads
    python scripts/bench_cpu_kernels.py --quick              # a few seconds (the smoke test)

1. Linears: one pass over a whole model's projection weights (distinct tensors, so they come from
   memory as in a real step, not from cache), per number of rows, with the weight as loaded
   (``TorchLinear``: ``F.linear``) and prepacked once for oneDNN (``PackedCpuLinear``).
2. Attention of one prefill chunk over its cached context with a mask (a chunk that continues a
   prompt), GQA: unbatched 3-D inputs, which PyTorch sends to its unfused "math" path, against
   batched 4-D inputs, which reach the fused CPU kernel (what ``TorchPagedAttention`` passes).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from evenflow.worker.models.linear import PackedCpuLinear, TorchLinear
from torch.profiler import profile

from evenflow.bench.shapes import MODELS


def projection_shapes(model: str) -> list[tuple[int, int]]:
    """(out, in) of every projection of a demo preset, fused as the worker fuses them, plus lm_head."""
    c = MODELS[model]
    h, heads, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    d, inter = h // heads, c["intermediate_size"]
    layer = [((heads + 2 * kv) * d, h), (h, heads * d), (2 * inter, h), (h, inter)]
    return layer * c["num_hidden_layers"] + [(c["vocab_size"], h)]


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def linear_table(models: list[str], rows: list[int], threads: list[int], repeats: int) -> None:
    print("linears: ms per pass over all of a model's projection weights (median)")
    print(f"{'model':>6} {'threads':>7} {'rows':>5} {'F.linear':>9} {'packed':>8} {'packed/F':>8}")
    kernels = (TorchLinear(), PackedCpuLinear())
    for model in models:
        g = torch.Generator().manual_seed(0)
        shapes = projection_shapes(model)
        weights = [torch.randn(n, k, generator=g) for n, k in shapes]
        prepared = [[kernel.prepare(w) for w in weights] for kernel in kernels]
        for n_threads in threads:
            torch.set_num_threads(n_threads)
            for m in rows:
                inputs = {k: torch.randn(m, k, generator=g) for k in {k for _, k in shapes}}
                ms = [median_ms(lambda kern=kern, ws=ws: [kern(inputs[w_k], w) for w, (_, w_k) in zip(ws, shapes)],
                                repeats) for kern, ws in zip(kernels, prepared)]
                print(f"{model:>6} {n_threads:>7} {m:>5} {ms[0]:>9.2f} {ms[1]:>8.2f} {ms[1] / ms[0]:>8.2f}")


def attention_table(chunk: int, context: int, threads: list[int], repeats: int) -> None:
    heads, kv_heads, head_dim = 4, 2, 64  # the tiny preset's
    g = torch.Generator().manual_seed(0)
    q = torch.randn(heads, chunk, head_dim, generator=g)
    k = torch.randn(kv_heads, context, head_dim, generator=g)
    v = torch.randn(kv_heads, context, head_dim, generator=g)
    visible = torch.arange(context)[None, :] <= torch.arange(context - chunk, context)[:, None]
    mask = torch.zeros(chunk, context).masked_fill_(~visible, float("-inf"))
    calls = {
        "3-D [H, n, D]": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
        "4-D [1, H, n, D]": lambda: F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask,
                                                                   enable_gqa=True)[0],
    }
    print(f"\nattention: a {chunk}-token chunk over a {context}-token context, {heads}/{kv_heads} heads, "
          f"head_dim {head_dim}, masked (median ms)")
    print(f"{'inputs':>17} {'threads':>7} {'ms':>8}  kernel")
    for n_threads in threads:
        torch.set_num_threads(n_threads)
        for name, call in calls.items():
            with profile() as prof:
                call()
            kernel = next((e.name for e in prof.events() if e.name.startswith("aten::_scaled_dot")), "?")
            print(f"{name:>17} {n_threads:>7} {median_ms(call, repeats):>8.2f}  {kernel}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model, few rows, 1 thread, short chunk")
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["tiny", "small"])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8, 32, 64, 264])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.rows, args.threads, args.chunk, args.context, args.repeats = ["tiny"], [1, 8], [1], 32, 128, 2
    if not PackedCpuLinear.works():
        print("this torch build has no oneDNN packed linear: nothing to compare", file=sys.stderr)
        return 1
    linear_table(args.models, args.rows, args.threads, args.repeats)
    attention_table(args.chunk, args.context, args.threads, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
