#!/usr/bin/env python3
"""Multi-LoRA cost: output tok/s and ITL p50/p99 with 0, 1, 4 and 8 adapters at the same load.

    python scripts/bench_lora.py --out-dir /tmp/bench-lora [--streams 8 --requests 2 --rounds 3]

Serves the real model (SmolLM2-135M-Instruct, an HF folder made from the cached GGUF) from one engine-core with
``--enable-lora --max-loras 8`` and eight random rank-8 adapters on every projection, plus one
engine-core without LoRA for the base row; see evenflow/bench/lora_load.py for the load.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from evenflow.bench.hf_folder import hf_folder_from_gguf
from evenflow.bench.lora_adapters import random_adapter, reseeded_copies, servable_model_dir
from evenflow.frontend.real_demo import fetch_demo_gguf
from evenflow.bench.lora_load import MixRecord, connect, run_round, start_engine, stop_engine
from evenflow.protocol import AdapterRef


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None,
                   help="an HF folder (default: SmolLM2-135M-Instruct, made from the cached GGUF by transformers)")
    p.add_argument("--out-dir", type=Path, default=Path(tempfile.gettempdir()) / "bench-lora")
    p.add_argument("--streams", type=int, default=8, help="concurrent closed-loop clients")
    p.add_argument("--requests", type=int, default=2, help="requests per client per round")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="rounds per mix (the order alternates)")
    p.add_argument("--mixes", default="0,1,4,8", help="adapters in the mix")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--engine-flags", default="--dtype float32 --max-num-batched-tokens 256 --max-num-seqs 16 "
                                             "--max-model-len 512 --num-kv-blocks 256 --client-timeout 60")
    args = p.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    model_dir = args.model or hf_folder_from_gguf(fetch_demo_gguf(quiet=True), args.out_dir / "smollm2-hf")
    model = servable_model_dir(model_dir, args.out_dir)
    mixes = [int(k) for k in args.mixes.split(",")]
    first = random_adapter(args.out_dir / "adapter", model, seed=0, rank=args.rank)
    folders = reseeded_copies(first, args.out_dir, max(mixes))
    names = [f"lora{i}" for i in range(len(folders))]
    base_flags = args.engine_flags.split()
    lora_flags = [*base_flags, "--enable-lora", "--max-loras", str(max(mixes)), "--max-lora-rank", str(args.rank),
                  "--lora-modules", *[f"{n}={f}" for n, f in zip(names, folders)]]
    addrs = [f"ipc://{args.out_dir}/lora.sock", f"ipc://{args.out_dir}/plain.sock"]
    procs = [start_engine(model, addrs[0], args.out_dir / "lora-engine.log", lora_flags),
             start_engine(model, addrs[1], args.out_dir / "plain-engine.log", base_flags)]
    try:
        asyncio.run(bench(args, addrs, mixes))
    finally:
        for proc in procs:
            stop_engine(proc)


async def bench(args: argparse.Namespace, addrs: list[str], mixes: list[int]) -> None:
    lora_client, plain_client = [await connect(a) for a in addrs]
    adapters: list[AdapterRef] = list(lora_client.ready.lora_adapters or [])  # type: ignore[union-attr]
    vocab = lora_client.ready.vocab_size  # type: ignore[union-attr]
    records = {"off": MixRecord("0 (LoRA off)"), **{k: MixRecord(str(k)) for k in mixes}}
    plan: list[tuple[object, object]] = [("off", plain_client)] + [(k, lora_client) for k in mixes]
    load = (args.streams, args.requests, args.prompt_len, args.output_len, vocab)
    for key, client in (plan[0], plan[-1]):  # warm-up: both engines, every adapter loaded
        await run_round(client, _mix(adapters, key), *load, seed=1, record=MixRecord("warm-up"))  # type: ignore[arg-type]
    for r in range(args.rounds):
        for key, client in (plan if r % 2 == 0 else plan[::-1]):
            await run_round(client, _mix(adapters, key), *load, seed=100 + r, record=records[key])  # type: ignore[arg-type]
    base = records[0] if 0 in records else records["off"]
    base_tok_s = base.tokens / base.seconds
    from evenflow.bench.stats import dist_ms
    import numpy as np

    base_p99 = dist_ms(np.asarray(base.gaps_s)).p99
    header = ["adapters in the mix", "output tok/s", "vs 0", "ITL p50 ms", "ITL p99 ms", "p99 vs 0"]
    rows = [rec.row(base_tok_s, base_p99) for rec in records.values()]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |")
    await lora_client.close()
    await plain_client.close()


def _mix(adapters: list[AdapterRef], key: object) -> list[AdapterRef | None]:
    return [None] if key in ("off", 0) else list(adapters[: int(key)])  # type: ignore[call-overload]


if __name__ == "__main__":
    main()
