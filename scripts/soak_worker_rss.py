"""Soak: does the worker's RSS plateau under steady load, or grow without bound?

    python scripts/soak_worker_rss.py --minutes 6 --variants default,arena2
    python scripts/soak_worker_rss.py --model real --engine-defaults --minutes 60 --slope-last 40 --csv rss.csv

Each variant starts one engine-core on the demo model (random weights, real tokenizer; ``--model
real``: the SmolLM2 GGUF, ``--model PATH``: any model; ``--engine-defaults``: the engine's own
settings instead of the small cache and budget below), drives it
with --clients concurrent requests of varied prompt and output lengths (new shapes keep coming,
as in real traffic) through the wire client, samples the worker's RSS every 10 s, and prints a
table: RSS at each minute and the growth over the last half of the run (MB/min; ``--slope-last N``:
a least-squares slope over the last N minutes). Variants:
``default`` (glibc's malloc as configured), ``arena2`` (MALLOC_ARENA_MAX=2), ``trim``
(MALLOC_TRIM_THRESHOLD_=0: freed memory returns to the OS at once), ``mmap128k``
(MALLOC_MMAP_THRESHOLD_=131072: every block over 128 KiB, a tensor, is its own mapping, unmapped
when freed; a fixed threshold also stops glibc from raising it after each free).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from evenflow.frontend.clients.engine_client import EngineClient  # noqa: E402
from evenflow.frontend.demo_model import ensure_demo_model  # noqa: E402
from evenflow.frontend.real_demo import fetch_demo_gguf  # noqa: E402
from evenflow.protocol import SamplingParams  # noqa: E402
from tests.e2e.harness import start_engine  # noqa: E402

VARIANTS = {"default": {}, "arena2": {"MALLOC_ARENA_MAX": "2"}, "trim": {"MALLOC_TRIM_THRESHOLD_": "0"},
            "mmap128k": {"MALLOC_MMAP_THRESHOLD_": "131072"}}
FLAGS = ("--max-model-len", "1024", "--num-kv-blocks", "256", "--max-num-batched-tokens", "256", "--max-num-seqs",
         "8", "--worker-threads", "1")


async def _load(address: str, clients: int, until: float, counts: list[int]) -> None:
    client = EngineClient(address, "soak")
    await client.connect(timeout=60)
    rng = random.Random(0)

    async def one(worker: int) -> None:
        i = 0
        while time.monotonic() < until:
            prompt = [rng.randrange(3, 4000) for _ in range(rng.randrange(4, 600))]
            sp = SamplingParams(max_tokens=rng.randrange(4, 200), temperature=0.8, seed=i)
            async for _ in client.generate(f"w{worker}-{i}", prompt, sp):
                pass
            counts[0] += 1
            i += 1

    await asyncio.gather(*(one(w) for w in range(clients)))
    await client.close()


def soak(variant: str, minutes: float, clients: int, model: Path, flags: tuple[str, ...]
         ) -> tuple[list[tuple[float, float]], int]:
    env_before = dict(os.environ)
    os.environ.update(VARIANTS[variant])  # the engine-core and its workers inherit it
    work = Path(tempfile.mkdtemp(prefix=f"soak-{variant}-"))
    try:
        engine = start_engine(model, work, *flags, ready_timeout=600)
    finally:
        os.environ.clear()
        os.environ.update(env_before)
    worker = psutil.Process(engine.worker_pids[0])
    samples: list[tuple[float, float]] = []
    counts = [0]
    start = time.monotonic()
    until = start + minutes * 60

    async def main() -> None:
        load = asyncio.ensure_future(_load(engine.address, clients, until, counts))
        while not load.done():
            samples.append(((time.monotonic() - start) / 60, worker.memory_info().rss / 2**20))
            await asyncio.sleep(10)
        await load

    try:
        asyncio.run(main())
    finally:
        engine.stop()
    return samples, counts[0]


def _slope(points: list[tuple[float, float]]) -> float:
    """Least-squares MB/min through (minute, RSS) points (0 for fewer than two)."""
    if len(points) < 2:
        return 0.0
    mx = sum(m for m, _ in points) / len(points)
    my = sum(r for _, r in points) / len(points)
    var = sum((m - mx) ** 2 for m, _ in points)
    return sum((m - mx) * (r - my) for m, r in points) / var if var else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=6.0)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--variants", default="default,arena2")
    ap.add_argument("--model", default="demo", help="demo, real (the SmolLM2 GGUF) or a model path")
    ap.add_argument("--engine-defaults", action="store_true", help="the engine's own flags, not the small ones")
    ap.add_argument("--slope-last", type=float, default=None, help="the slope over the last N minutes")
    ap.add_argument("--csv", type=Path, default=None, help="write every sample (variant, minute, RSS MB)")
    args = ap.parse_args()
    model = {"demo": ensure_demo_model, "real": lambda: fetch_demo_gguf(quiet=True)}.get(args.model,
                                                                                       lambda: Path(args.model))()
    flags = () if args.engine_defaults else FLAGS
    rows = []
    for variant in args.variants.split(","):
        samples, done = soak(variant, args.minutes, args.clients, model, flags)
        if args.csv is not None:
            with args.csv.open("a") as f:
                f.writelines(f"{variant},{m:.3f},{rss:.1f}\n" for m, rss in samples)
        at = {int(m): rss for m, rss in samples}  # the last sample of each minute
        tail_from = args.minutes - args.slope_last if args.slope_last else args.minutes / 2
        slope = _slope([(m, r) for m, r in samples if m >= tail_from])
        rows.append((variant, done, samples[0][1], at, samples[-1][1], slope))
        print(f"{variant}: {done} requests, worker RSS {samples[0][1]:.0f} -> {samples[-1][1]:.0f} MB", flush=True)
    minutes = sorted({m for row in rows for m in row[3]})
    what = f"last {args.slope_last:g} min" if args.slope_last else "2nd half"
    print("\n| variant | requests | " + " | ".join(f"RSS @{m} min (MB)" for m in minutes)
          + f" | growth, {what} (MB/min) |")
    print("|---|---|" + "---|" * len(minutes) + "---|")
    for variant, done, _first, at, _last, slope in rows:
        print(f"| {variant} | {done} | " + " | ".join(f"{at.get(m, float('nan')):.0f}" for m in minutes)
              + f" | {slope:+.1f} |")


if __name__ == "__main__":
    main()
