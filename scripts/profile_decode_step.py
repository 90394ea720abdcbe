#!/usr/bin/env python3
"""Single-stream decode: one B=1 step in process by part, against per-token time end to end
(evenflow/bench/decode_latency.py). Modes alternate order over rounds; the median round is kept.

    python scripts/profile_decode_step.py --model /path/SmolLM2-135M-Instruct.Q4_1.gguf --modes float32,bfloat16,int4
    python scripts/profile_decode_step.py --model M.gguf --modes int4 --ops 1,2   # by op class, 1 and 2 threads
"""

from __future__ import annotations

import argparse
import logging
import statistics

from evenflow.bench.decode_latency import LatencyRow, end_to_end_per_token, format_table, in_process_split, runner_for
from evenflow.bench.op_profile import OpSplit, format_op_table, op_split
from evenflow.bench.roofline import StepSplit


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--modes", default="float32,bfloat16,int4")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--ops", default="", help="comma-separated thread counts: only the in-process split by op class")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    modes = args.modes.split(",")
    if args.ops:
        ops: dict[str, OpSplit] = {}
        for mode in modes:
            for threads in (int(t) for t in args.ops.split(",")):
                ops[f"{mode}, {threads} thr"] = op_split(runner_for(args.model, mode, args.context, threads), 1,
                                                         args.context, args.steps)
        print(f"ms a step (top-level aten calls a step), B=1, context {args.context}, mean of {args.steps} steps")
        print(format_op_table(ops))
        return
    splits: dict[str, list[StepSplit]] = {m: [] for m in modes}
    e2e: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            splits[mode].append(in_process_split(args.model, mode, args.context, args.threads, args.steps))
            e2e[mode].append(end_to_end_per_token(args.model, mode, args.context, args.tokens, args.threads))
            print(f"round {r} {mode}: step {splits[mode][-1].total_s * 1e3:.1f} ms, "
                  f"end to end {e2e[mode][-1] * 1e3:.1f} ms/token", flush=True)
    rows = [LatencyRow(m, sorted(splits[m], key=lambda s: s.total_s)[len(splits[m]) // 2],
                       statistics.median(e2e[m])) for m in modes]
    print()
    print(format_table(rows))


if __name__ == "__main__":
    main()
