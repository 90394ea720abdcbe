#!/usr/bin/env python3
"""llama.cpp (``llama-batched-bench``) against evenflow's offline ``LLM`` on the same GGUF, one run:
B sequences of ``--prompt`` tokens each generating ``--gen`` greedy tokens, for every B, the two
engines alternating order over ``--rounds``; medians per engine and the decode ratio
(evenflow/bench/llamacpp_offline.py says how each figure is taken).

    python scripts/bench_llamacpp_offline.py --model SmolLM2-135M-Instruct.Q4_1.gguf \\
        --llama-bin /work/peers/llama/build/bin --batches 1,8,32 --threads 2 --rounds 2

evenflow serves the GGUF at its defaults (int4 projections where the start-up measurement chose them);
``--evenflow-arg quantization=none`` and the like pass engine arguments. Both engines spin their
threads: run it on an otherwise idle machine; the load average is printed with the table.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from evenflow.bench.llamacpp_offline import SpeedRow, evenflow_row, format_rows, llamacpp_row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="the GGUF both engines serve")
    p.add_argument("--llama-bin", default="/work/peers/llama/build/bin", help="folder holding llama-batched-bench")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--evenflow-arg", action="append", default=[], help="KEY=VALUE engine argument (repeatable)")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    binary = Path(args.llama_bin) / "llama-batched-bench"
    if not binary.exists():
        raise SystemExit(f"{binary} not found: build llama.cpp (docs/peer.md, or /work/shared/peers/LLAMA_CPP.md)")
    engine_args = dict(kv.split("=", 1) for kv in args.evenflow_arg)
    rows: list[SpeedRow] = []
    for batch in (int(b) for b in args.batches.split(",")):
        for r in range(args.rounds):
            order = ("llama.cpp", "evenflow") if r % 2 == 0 else ("evenflow", "llama.cpp")
            for engine in order:
                if engine == "llama.cpp":
                    row = llamacpp_row(binary, args.model, batch, args.prompt, args.gen, args.threads)
                else:
                    row = evenflow_row(args.model, batch, args.prompt, args.gen, args.threads, engine_args=engine_args)
                rows.append(row)
                print(f"B={batch} round {r} {engine}: prefill {row.prefill_tok_s:.0f} tok/s, "
                      f"decode {row.decode_tok_s:.1f} tok/s", flush=True)
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    print(f"\n{args.prompt}-token prompts, {args.gen} generated each, {args.threads} threads, median of "
          f"{args.rounds} rounds (order alternating); load average {load}")
    print(format_rows(rows))


if __name__ == "__main__":
    main()
