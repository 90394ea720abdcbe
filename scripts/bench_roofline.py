#!/usr/bin/env python3
"""A decode step against the memory roofline (evenflow/bench/roofline.py): measured read bandwidth,
the bytes a step reads (weights + KV), the step's split, and its ratio to the roofline.

    python scripts/bench_roofline.py --model /path/SmolLM2-135M-Instruct.Q4_1.gguf --modes float32,bfloat16,int4
    python scripts/bench_roofline.py --model M1.gguf --model M2.gguf --batch 1,8 --context 128 --threads 2
    python scripts/bench_roofline.py --model M.gguf --modes int4 --batch 1 --rounds 5   # a shared machine: rounds
    python scripts/bench_roofline.py --kernels --threads 1      # the linear kernels alone, ms per call

int4 needs a GGUF holding Q4_0/Q4_1 projections; float32 and bfloat16 dequantize it (or read an HF folder).
"""

from __future__ import annotations

import argparse
import logging
import time

import torch

from evenflow.bench.int4_kernels import kernel_table
from evenflow.bench.roofline import format_table, ratio_summary, roofline_rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", default=[], help="a GGUF file or HF folder (repeatable)")
    p.add_argument("--kernels", action="store_true", help="also time the linear kernels alone per shape")
    p.add_argument("--modes", default="float32,bfloat16,int4")
    p.add_argument("--batch", default="1", help="comma-separated decode batch sizes")
    p.add_argument("--context", type=int, default=128, help="tokens of context per sequence")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per row (median reported)")
    p.add_argument("--rounds", type=int, default=1,
                   help="rounds of each row, each measuring the read bandwidth and then the step (a ratio per round)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu: the process's CPU time, which leaves out waits for a core on a shared machine "
                        "(one thread: the step's own cost; more threads: their sum)")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    if args.kernels:
        print(f"linear kernels, ms per call, {args.threads} threads, min of 7 interleaved trials")
        print(kernel_table())
        print()
    if not args.model:
        return
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(f"read bandwidth: {args.threads} threads, best of 7 sums of 256 MiB before each round's steps, "
          f"{args.clock} clock")
    rows, summaries = [], []
    for model in args.model:
        for mode in args.modes.split(","):
            if mode == "int4" and not model.endswith(".gguf"):
                continue
            for batch in (int(b) for b in args.batch.split(",")):
                measured = roofline_rows(model, mode, batch, args.context, args.threads, args.steps, clock,
                                         args.rounds)
                for row in measured:
                    print(format_table([row]).splitlines()[-1], flush=True)
                rows += measured
                summaries.append(ratio_summary(measured))
    print()
    print(format_table(rows))
    if args.rounds > 1:
        print()
        print("\n".join(summaries))


if __name__ == "__main__":
    main()
