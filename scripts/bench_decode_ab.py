#!/usr/bin/env python3
"""One decode step (B=1 unless ``--batch``), before against after a change: each git revision's tree
is exported to a temp folder and timed in its own process (forward + greedy sampling, ``--steps``
steps), the revisions alternating order over ``--rounds``; the table gives every revision's min and
median wall time of a step and its median CPU time (the process's, each the median over rounds), with their ratios to the
first. On a shared machine the CPU time is the steady figure: it leaves out the time the process
waited for a core (at one thread it is the step's own cost; at more it sums the threads).

    python scripts/bench_decode_ab.py --model SmolLM2-135M-Instruct.Q4_1.gguf --rev HEAD~1 --rev HEAD
    python scripts/bench_decode_ab.py --model M.gguf --rev main --rev WORKTREE --threads 2   # uncommitted tree
    python scripts/bench_decode_ab.py --model M.gguf --rev OLD --rev HEAD --mode auto   # default against default
    python scripts/bench_decode_ab.py --model M.gguf --rev OLD --rev HEAD --batch 8 --sampled   # 8 sampled streams

The load average is printed beside the table: on a shared machine only the ratios within one run count.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Only interfaces every revision has (WorkerConfig, ModelRunner, synthetic_step), so any two can be compared;
# the forward's ``greedy`` flag only where the revision has it.
SNIPPET = """
import inspect, logging, sys, time, torch
logging.disable(logging.WARNING)
from evenflow.protocol import WorkerConfig
from evenflow.worker.runner import ModelRunner
from evenflow.worker.sampling_metadata import SamplingMetadata
from evenflow.worker.synthetic_steps import synthetic_step
model, mode, context, threads, steps, batch = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
sampled = sys.argv[7] == "1"
torch.set_num_threads(threads)
gguf = model.endswith(".gguf")
# auto: the engine's defaults (--dtype auto, no --quantization: what the revision serves a GGUF as)
dtype = {"bfloat16": "bfloat16", "auto": "auto"}.get(mode, "float32")
quantization = None if mode == "auto" or not gguf else ("gguf" if mode == "int4" else "none")
runner = ModelRunner(WorkerConfig(model=model, dtype=dtype, device="cpu",
                                  block_size=16, max_model_len=context + 16, num_kv_blocks=batch * (context // 16 + 2),
                                  num_threads=threads, quantization=quantization))
torch.set_num_threads(threads)
step = synthetic_step([1] * batch, [context] * batch, runner.block_size, runner.device)
caches = runner._scratch_caches(step.num_blocks)
meta = SamplingMetadata(num_reqs=batch, vocab_size=runner.vocab_size)
# Plain greedy, as the runner tells a forward that has the flag (argmax-only LM head); sampled: every
# logit as sampling reads them (the sampler then still takes the argmax).
has_flag = "greedy" in inspect.signature(runner.model.forward).parameters
greedy = {"greedy": True} if has_flag and not sampled else {}
wall, cpu = [], []
with torch.inference_mode():
    for i in range(steps + 3):
        t0, c0 = time.perf_counter(), time.process_time()
        logits = runner.model(step.input_ids, step.positions, caches, runner.attn, runner.attn.plan(step.attn),
                              step.logits_indices, **greedy)
        runner.sampler(logits, meta).sampled_token_ids.tolist()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
wall, cpu = sorted(wall[3:]), sorted(cpu[3:])
print("STEP", wall[0], wall[len(wall) // 2], cpu[len(cpu) // 2])
"""


def export(rev: str, into: Path) -> Path:
    """The tree of ``rev`` (``WORKTREE``: this checkout as it is) as a folder to put on PYTHONPATH."""
    if rev == "WORKTREE":
        return ROOT
    out = into / rev.replace("/", "_").replace("~", "-")
    out.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "evenflow"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive.stdout, check=True)
    return out


def time_step(tree: Path, args: argparse.Namespace) -> list[float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    # cwd: the tree itself, since ``python -c`` puts the working directory first on sys.path.
    proc = subprocess.run([sys.executable, "-c", SNIPPET, args.model, args.mode, str(args.context),
                           str(args.threads), str(args.steps), str(args.batch), str(int(args.sampled))],
                          env=env, cwd=tree, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{tree}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("STEP"))
    return [float(v) for v in line.split()[1:]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--rev", action="append", required=True, help="git revision, or WORKTREE (repeatable)")
    p.add_argument("--mode", default="int4", help="float32, bfloat16, int4, or auto (the engine's defaults)")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--batch", type=int, default=1, help="decode sequences a step")
    p.add_argument("--sampled", action="store_true", help="the LM head computes every logit, as sampling reads them")
    args = p.parse_args()
    times: dict[str, list[list[float]]] = {rev: [] for rev in args.rev}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {rev: export(rev, Path(tmp)) for rev in args.rev}
        for r in range(args.rounds):
            for rev in args.rev if r % 2 == 0 else args.rev[::-1]:
                times[rev].append(time_step(trees[rev], args))
                best, med, cpu = times[rev][-1]
                print(f"round {r} {rev}: step min {best * 1e3:.2f} / median {med * 1e3:.2f} ms wall, "
                      f"median {cpu * 1e3:.2f} ms CPU", flush=True)
    kind = "sampled" if args.sampled else "greedy"
    print(f"\nload average {os.getloadavg()[0]:.2f}; {args.mode}, B={args.batch} {kind}, context {args.context}, "
          f"{args.threads} threads, "
          f"median over {args.rounds} rounds of each round's figure over {args.steps} steps")
    print("| revision | min wall ms | median wall ms | median CPU ms | min wall vs first | CPU vs first |")
    print("|---|--:|--:|--:|--:|--:|")
    first: list[float] | None = None
    for rev in args.rev:
        cols = [statistics.median(col) * 1e3 for col in zip(*times[rev])]
        first = first or cols
        print(f"| {rev} | {cols[0]:.2f} | {cols[1]:.2f} | {cols[2]:.2f} | {cols[0] / first[0]:.3f} | "
              f"{cols[2] / first[2]:.3f} |")


if __name__ == "__main__":
    main()
