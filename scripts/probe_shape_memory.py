"""Worker RSS against new step shapes, with and without the row tiles of worker/models/row_tiles.py.

    python scripts/probe_shape_memory.py --passes 4 --steps 24 --dtypes auto,float32

Each (dtype, tiles) variant runs in its own process (variants alternate, so the machine's state is
shared evenly): a ModelRunner on the real model GGUF, then ``--passes`` passes of ``--steps``
steps each, every step of a token count no earlier step had (65-512 tokens: the row counts oneDNN
would otherwise keep a primitive for). Prints RSS after each pass and the growth per new shape
over the passes after the first (the first also fills what row_tiles allows: its bounded set).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MAX_MODEL_LEN, NUM_BLOCKS, BLOCK = 1024, 192, 16


def child(args: argparse.Namespace) -> None:
    from evenflow.bench.shape_memory import rss_mb, run_steps, step_of
    from evenflow.frontend.real_demo import fetch_demo_gguf
    from evenflow.protocol import WorkerConfig
    from evenflow.worker.models import row_tiles
    from evenflow.worker.runner import ModelRunner

    if not args.tiles:
        row_tiles.EXACT_ROWS = 1 << 30  # every GEMM on its own row count, as before row_tiles
    cfg = WorkerConfig(model=str(fetch_demo_gguf(quiet=True)), dtype=args.dtype, device="cpu", block_size=BLOCK,
                       max_model_len=MAX_MODEL_LEN, num_kv_blocks=NUM_BLOCKS, num_threads=1)
    runner = ModelRunner(cfg)
    runner.init_kv_cache(NUM_BLOCKS)
    rng = random.Random(0)
    totals = rng.sample(range(65, 513), args.passes * args.steps)
    run_steps(runner, [step_of(n, rng, MAX_MODEL_LEN, BLOCK, NUM_BLOCKS) for n in range(1, 9)])
    out = {"start": rss_mb(), "passes": []}
    t0 = time.monotonic()
    for p in range(args.passes):
        run_steps(runner, [step_of(n, rng, MAX_MODEL_LEN, BLOCK, NUM_BLOCKS)
                           for n in totals[p * args.steps : (p + 1) * args.steps]])
        out["passes"].append(rss_mb())
    out["seconds"] = time.monotonic() - t0
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--passes", type=int, default=4)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--dtypes", default="auto,float32")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="auto", help=argparse.SUPPRESS)
    ap.add_argument("--tiles", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    rows = []
    for dtype in args.dtypes.split(","):
        for tiles in (0, 1) if len(rows) % 4 == 0 else (1, 0):
            res = subprocess.run([sys.executable, __file__, "--child", "--dtype", dtype, "--tiles", str(tiles),
                                  "--passes", str(args.passes), "--steps", str(args.steps)],
                                 capture_output=True, text=True, check=True)
            r = json.loads(res.stdout.strip().splitlines()[-1])
            later = (r["passes"][-1] - r["passes"][0]) / ((args.passes - 1) * args.steps) if args.passes > 1 else 0
            rows.append((dtype, "row tiles" if tiles else "every row count", r, later))
            print(f"{dtype} tiles={tiles}: {r}", file=sys.stderr, flush=True)
    print("\n| dtype | GEMM rows | RSS start (MB) | " + " | ".join(f"after pass {i + 1}" for i in range(args.passes))
          + " | MB per new shape, passes 2+ | seconds |")
    print("|---|---|---|" + "---|" * args.passes + "---|---|")
    for dtype, mode, r, later in rows:
        print(f"| {dtype} | {mode} | {r['start']:.0f} | " + " | ".join(f"{x:.0f}" for x in r["passes"])
              + f" | {later:.2f} | {r['seconds']:.0f} |")


if __name__ == "__main__":
    main()
