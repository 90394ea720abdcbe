"""How long a GGUF takes to load, by phase, in one process: header + config (what the engine-core
reads), the tokenizer (what each frontend builds), and the dequantization of every tensor to
``--dtype`` (the worker's part), best and median of ``--repeats`` rounds.

    python scripts/bench_gguf_load.py                    # the demo model (fetched once, as `evenflow serve` does)
    python scripts/bench_gguf_load.py --model FILE.gguf --dtype bfloat16 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from evenflow.frontend.real_demo import fetch_demo_gguf
from evenflow.protocol.gguf_tokenizer import read_gguf_tokenizer
from evenflow.worker.config_reader import read_model_config
from evenflow.worker.gguf_weights import dequantize_raw, iter_gguf_raw_tensors
from evenflow.worker.loader import DTYPES


def one_round(path: Path, dtype: torch.dtype) -> dict[str, float]:
    t0 = time.perf_counter()
    cfg = read_model_config(path)
    t1 = time.perf_counter()
    read_gguf_tokenizer(path)
    t2 = time.perf_counter()
    for tensor in iter_gguf_raw_tensors(path, cfg):
        dequantize_raw(tensor, dtype)
    t3 = time.perf_counter()
    return {"header+config": t1 - t0, "tokenizer": t2 - t1, "dequantize": t3 - t2}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="a .gguf file (default: the demo model)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    path = args.model or fetch_demo_gguf()
    rounds = [one_round(path, DTYPES[args.dtype]) for _ in range(args.repeats)]
    print(f"{path.name}, {path.stat().st_size / 2**20:.0f} MiB, to {args.dtype}, {args.repeats} rounds, "
          f"torch threads {torch.get_num_threads()}")
    print("| phase | best s | median s |\n|---|---:|---:|")
    for phase in rounds[0]:
        values = [r[phase] for r in rounds]
        print(f"| {phase} | {min(values):.2f} | {statistics.median(values):.2f} |")
    totals = [sum(r.values()) for r in rounds]
    print(f"| total | {min(totals):.2f} | {statistics.median(totals):.2f} |")


if __name__ == "__main__":
    main()
