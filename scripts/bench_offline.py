"""Offline throughput of the worker's model runner, driven in-process by the engine's step loop.

    python scripts/bench_offline.py --quick                 # a short smoke table
    python scripts/bench_offline.py --models small --dtypes bfloat16 --batch-sizes 64 \
        --min-prompt 128 --max-prompt 512 --output-len 128    # the vLLM-CPU comparison point

Random ("dummy") weights from a config alone: "tiny" (hidden 256, 4 layers, 4/2 heads, ffn 768,
vocab 8192), "small" (hidden 1024, 8 layers, 16/4 heads, ffn 2816, vocab 8192) and "1b" (Llama-3.2-1B's
shape, for GPUs: ``--device cuda``). For each model,
dtype and batch size, ``batch`` synthetic prompts (lengths uniform in [min, max]) each generate
``output-len`` tokens (ignore_eos); every request is submitted at once, so the batch size is the
number of concurrent sequences. Printed per row: input and output tokens per second over the whole
run, and the mean per-step split of the worker's time (input building / forward / sampling) plus
the scheduler's own time. The steps go through the engine's ``EngineLoop`` and an
``InProcessExecutor`` (``--async-scheduling``: two steps in flight, as the engine runs by default).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from evenflow.bench.shapes import MODELS
from evenflow.core.engine_loop import EngineLoop
from evenflow.core.request import Request
from evenflow.core.sched.config import SchedulerConfig
from evenflow.core.sched.scheduler import Scheduler
from evenflow.protocol import SamplingParams, WorkerConfig
from evenflow.worker.in_process import InProcessExecutor
from evenflow.worker.runner import ModelRunner


@dataclass
class Row:
    model: str
    dtype: str
    batch: int
    input_tokens: int
    output_tokens: int
    wall_s: float
    steps: int
    prepare_s: float
    forward_s: float
    sample_s: float
    schedule_s: float

    def cells(self) -> list[str]:
        per_step = lambda x: f"{1000 * x / max(self.steps, 1):.2f}"  # noqa: E731
        return [self.model, self.dtype, str(self.batch), f"{self.input_tokens / self.wall_s:.0f}",
                f"{self.output_tokens / self.wall_s:.0f}", f"{self.wall_s:.1f}", str(self.steps),
                per_step(self.prepare_s), per_step(self.forward_s), per_step(self.sample_s), per_step(self.schedule_s)]


HEADER = ["model", "dtype", "batch", "in tok/s", "out tok/s", "wall s", "steps", "prep ms", "fwd ms", "sample ms",
          "sched ms"]


def write_config(root: Path, name: str) -> Path:
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", max_position_embeddings=4096,
               rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16",
               **{"tie_word_embeddings": False, **MODELS[name]})
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def run_one(model_dir: Path, name: str, dtype: str, batch: int, args: argparse.Namespace) -> Row:
    max_len = args.max_prompt + args.output_len + 1
    blocks_needed = batch * (-(-max_len // args.block_size)) + 1  # never preempt: measure throughput
    worker_cfg = WorkerConfig(model=str(model_dir), dtype=dtype, device=args.device, block_size=args.block_size,
                              attention_backend=args.attention_backend,
                              max_model_len=max_len, max_num_batched_tokens=args.budget, max_num_seqs=batch,
                              load_format="dummy", num_threads=args.threads, num_kv_blocks=blocks_needed)
    runner = ModelRunner(worker_cfg)
    runner.init_kv_cache(blocks_needed)
    sched = Scheduler(SchedulerConfig(num_kv_blocks=blocks_needed, max_num_batched_tokens=args.budget,
                                      max_num_seqs=batch, max_model_len=max_len, block_size=runner.block_size,
                                      enable_prefix_caching=False))
    loop = EngineLoop(sched, InProcessExecutor(runner=runner), async_scheduling=args.async_scheduling)
    rng = random.Random(args.seed)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    prompts = [[rng.randrange(3, 8192) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
               for _ in range(batch)]
    for i, prompt in enumerate(prompts):
        sched.add_request(Request(f"r{i}", prompt, params))
    out_tokens = 0
    t0 = time.perf_counter()
    while loop.has_work():
        out_tokens += sum(len(o.new_token_ids) for o in loop.step().outputs or ())
    wall = time.perf_counter() - t0
    runner.shutdown()
    stats = loop.stats()
    return Row(name, runner.dtype, batch, sum(map(len, prompts)), out_tokens, wall, stats.scheduler.num_steps,
               stats.workers.prepare_s, stats.workers.forward_s, stats.workers.sample_s,
               stats.scheduler.schedule_s + stats.scheduler.update_s)


def print_table(rows: list[Row]) -> None:
    table = [HEADER] + [r.cells() for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(HEADER))]
    for row in table:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths)), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model, float32, batches 1 and 16, short prompts")
    parser.add_argument("--models", nargs="+", default=["tiny", "small"], choices=sorted(MODELS))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 4, 16, 64, 256])
    parser.add_argument("--min-prompt", type=int, default=128)
    parser.add_argument("--max-prompt", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    parser.add_argument("--attention-backend", default="auto", choices=("auto", "torch", "triton", "flash_attn"))
    parser.add_argument("--async-scheduling", action="store_true",
                        help="two steps in flight (the engine's default); off: schedule -> run -> apply")
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.dtypes, args.batch_sizes = ["tiny"], ["float32"], [1, 16]
        args.min_prompt, args.max_prompt, args.output_len = 32, 64, 16
    print(f"torch {torch.__version__}, {torch.get_num_threads() if args.threads is None else args.threads} threads, "
          f"device {args.device}", file=sys.stderr)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            model_dir = write_config(Path(tmp), name)
            for dtype in args.dtypes:
                for batch in args.batch_sizes:
                    rows.append(run_one(model_dir, name, dtype, batch, args))
                    print_table(rows[-1:] if len(rows) > 1 else rows)
    print()
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
