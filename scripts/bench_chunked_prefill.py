#!/usr/bin/env python3
"""What chunked prefill costs one prompt alone, against the same prompt in one step.

    python scripts/bench_chunked_prefill.py --model-dir /tmp/tiny [--lengths 2048,8192,16384]
        [--budgets 64,256,512,2048,unchunked] [--repeats 2]
    python scripts/bench_chunked_prefill.py --model-dir FILE.gguf --lengths 2048,8000

Each prompt is prefilled alone through the worker's model runner (for a folder, random weights of the
model's shape, max_position_embeddings raised to the longest length; for a GGUF file, its weights as
served: 4-bit projections where the start-up measurement keeps them), in chunks of each budget, best of
``--repeats`` (the budgets in turn, the order reversed every other repeat); the table gives each
budget's time and its overhead over unchunked. One torch thread, timed in CPU seconds of that thread,
so that other processes on a shared machine do not count (their cache and memory traffic still do). What the overhead measures is what grows with the
context in the chunk path: attention over the cached K/V per chunk and layer, its gathers, masks.
"""

from __future__ import annotations

import argparse

from evenflow.bench.chunk_overhead import measure, overhead_table
from evenflow.protocol.gguf_file import is_gguf_path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", required=True,
                    help="a model folder (only its config.json is read) or a GGUF file (its weights are loaded)")
    ap.add_argument("--lengths", default="2048,8192,16384")
    ap.add_argument("--budgets", default="64,256,512,2048,unchunked")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default=None, help="default: auto for a GGUF file (as served), else float32")
    args = ap.parse_args()
    lengths = [int(v) for v in args.lengths.split(",")]
    chunks = [None if b == "unchunked" else int(b) for b in args.budgets.split(",")]
    dtype = args.dtype or ("auto" if is_gguf_path(args.model_dir) else "float32")
    timings = measure(args.model_dir, lengths, chunks, args.repeats, dtype)
    print(overhead_table(timings))


if __name__ == "__main__":
    main()
