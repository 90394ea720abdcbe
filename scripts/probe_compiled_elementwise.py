#!/usr/bin/env python3
"""Eager against compiled elementwise groups (evenflow/worker/models/compiled_ops.py), two ways:

* whole steps of a model (``--model-dir``, a GGUF served on the narrowing path): D decodes beside
  one prefill chunk of P tokens, prepare + forward + sample, the model's compiled groups on and off
  in alternating rounds (the best of the rounds kept per shape);
* ``--isolated``: the three groups alone at SmolLM2-135M's widths, per row count.

    python scripts/probe_compiled_elementwise.py --model-dir SmolLM2-135M-Instruct.Q4_1.gguf \
        [--chunks 2048,512,256,192,128] [--decodes 6] [--rounds 4]
    python scripts/probe_compiled_elementwise.py --isolated [--rows 2048,192,7]

The first compile of a machine takes ~20 s; inductor's cache serves later runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from evenflow.bench.call_timing import per_call_ms
from evenflow.protocol import WorkerConfig
from evenflow.worker.models.compiled_ops import CompiledOps, add_norm, compile_layer_ops, rotary_qk, swiglu
from evenflow.worker.runner import ModelRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_step_time import Shape, StepTimer  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 576, 9, 3, 64, 1536  # SmolLM2-135M
QK_END = (HEADS + KV_HEADS) * HEAD_DIM


def whole_steps(args: argparse.Namespace) -> None:
    chunks = [int(c) for c in args.chunks.split(",")]
    runner = ModelRunner(WorkerConfig(model=args.model_dir, dtype="auto", device="cpu", block_size=16,
                                      max_model_len=4096, num_kv_blocks=1024, max_num_seqs=args.decodes + 1,
                                      max_num_batched_tokens=max(chunks) + args.decodes, enforce_eager=True))
    runner.init_kv_cache(1024)
    t = time.perf_counter()
    print(f"compile: {compile_layer_ops(runner.model, min(chunks))} ({time.perf_counter() - t:.1f} s in all)")
    ops = runner.model.compiled_ops
    if ops is None:
        return
    runner.model.layer_glue = None  # eager against compiled (the C++ groups: bench_decode_ab.py)
    timer = StepTimer(runner, 16)
    shapes = [Shape(args.decodes, 256, c, 1024 if c < 2048 else 0) for c in chunks]
    seconds: dict[tuple[Shape, bool], list[float]] = {}
    for r in range(args.rounds):
        for compiled in (False, True) if r % 2 == 0 else (True, False):
            runner.model.compiled_ops = ops if compiled else None
            for s in shapes:
                seconds.setdefault((s, compiled), []).append(timer.time(s, 3))
    print(f"| decodes | chunk | chunk context | eager ms | compiled ms | compiled / eager |\n|--:|--:|--:|--:|--:|--:|")
    for s in shapes:
        e, c = min(seconds[(s, False)]), min(seconds[(s, True)])
        print(f"| {s.decodes} | {s.chunk} | {s.chunk_context} | {e * 1e3:.1f} | {c * 1e3:.1f} | {c / e:.3f} |")


def isolated(args: argparse.Namespace) -> None:
    ops = CompiledOps(2, HIDDEN, QK_END + KV_HEADS * HEAD_DIM, QK_END, HEAD_DIM, INTER, torch.bfloat16,
                      torch.bfloat16, torch.float32)
    start = time.perf_counter()
    ops.warm_up()
    print(f"compile (first call): {time.perf_counter() - start:.1f} s")
    print("| rows | eager ms | compiled ms | compiled / eager |\n|--:|--:|--:|--:|")
    for rows in (int(r) for r in args.rows.split(",")):
        x, w, eps = torch.randn(rows, HIDDEN), torch.rand(HIDDEN), torch.tensor(0.1)
        delta = torch.randn(rows, HIDDEN).bfloat16()
        qkv, gu = torch.randn(rows, QK_END + KV_HEADS * HEAD_DIM).bfloat16(), torch.randn(rows, 2 * INTER).bfloat16()
        cos, sin = torch.rand(rows, 1, HEAD_DIM), torch.rand(rows, 1, HEAD_DIM)

        def eager() -> None:
            add_norm(x, delta, w, eps, torch.bfloat16)
            rotary_qk(qkv, cos, sin, QK_END, HEAD_DIM, torch.bfloat16)
            swiglu(gu, INTER, torch.bfloat16)

        def compiled() -> None:
            ops.add_norm(x, delta, w, eps)
            ops.rotary_qk(qkv, cos, sin)
            ops.swiglu(gu)

        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        with torch.inference_mode():
            for r in range(3):  # alternating order, best of 3
                order = [("eager", eager), ("compiled", compiled)]
                for name, fn in order if r % 2 == 0 else order[::-1]:
                    times[name].append(per_call_ms(fn, 20))
        e, c = min(times["eager"]), min(times["compiled"])
        print(f"| {rows} | {e:.3f} | {c:.3f} | {c / e:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", help="a 4-bit GGUF: whole steps")
    ap.add_argument("--chunks", default="2048,512,256,192,128")
    ap.add_argument("--decodes", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--isolated", action="store_true", help="the three groups alone at SmolLM2's widths")
    ap.add_argument("--rows", default="2048,192,7")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.isolated:
        isolated(args)
    elif args.model_dir:
        whole_steps(args)
    else:
        ap.error("give --model-dir or --isolated")


if __name__ == "__main__":
    main()
