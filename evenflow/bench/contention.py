"""Throughput alone and next to a busy process: the same batch of concurrent requests, rounds
alternating between a quiet machine and one with ``python -c 'while True: pass'`` running (pinned
to one core or not), for each worker thread setting. A shared machine is noisy, so only ratios
within one run are compared: busy / alone per setting, rounds interleaved."""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

from evenflow.frontend.llm import LLM, SamplingParams

PROMPTS = [
    "Explain why the sky is blue.", "Write a haiku about rivers.", "What is 17 times 23?",
    "Name three planets and one fact each.", "Give a recipe for pancakes.", "Summarize the plot of Hamlet.",
    "What does a CPU cache do?", "Translate 'good morning' into French and Spanish.",
    "List five prime numbers.", "Why do cats purr?", "Describe a sunset in two sentences.",
    "How does a bicycle stay upright?", "What is photosynthesis?",
]


@dataclass
class Setting:
    name: str
    engine_args: dict[str, object]
    env: dict[str, str] = field(default_factory=dict)  # for the engine-core and its workers
    alone: list[float] = field(default_factory=list)
    busy: list[float] = field(default_factory=list)


def busy_process(pin: int | None) -> subprocess.Popen:
    """One busy-looping Python process, pinned to CPU ``pin`` when given."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"],
                            preexec_fn=(lambda: os.sched_setaffinity(0, {pin})) if pin is not None else None)


def run_batch(llm: LLM, num_requests: int, max_tokens: int) -> float:
    prompts = [[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}] for i in range(num_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    llm.chat(prompts, params, use_tqdm=False)  # type: ignore[arg-type]
    return time.perf_counter() - t0


def measure(setting: Setting, model: str, rounds: int, num_requests: int, max_tokens: int, pin: int | None,
            common: dict[str, object]) -> None:
    saved = {k: os.environ.get(k) for k in setting.env}
    os.environ.update(setting.env)  # the engine-core (and its workers) inherit it at start
    try:
        llm = LLM(model, **common, **setting.engine_args)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    with llm:
        run_batch(llm, num_requests, max_tokens)  # warm-up
        for r in range(rounds):
            order = ("alone", "busy") if r % 2 == 0 else ("busy", "alone")
            for which in order:
                proc = busy_process(pin) if which == "busy" else None
                try:
                    time.sleep(0.5 if proc else 0.0)
                    seconds = run_batch(llm, num_requests, max_tokens)
                finally:
                    if proc is not None:
                        proc.kill()
                        proc.wait()
                getattr(setting, which).append(seconds)
                print(f"  {setting.name:<22} round {r} {which:<5} {seconds:6.2f} s", flush=True)


def wait_env(setting: str) -> dict[str, str]:
    """The OpenMP wait variables a ``--threads`` setting exports (none: the worker's own choice)."""
    if setting == "auto-passive":
        return {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}
    if setting.startswith("auto-spin"):
        return {"GOMP_SPINCOUNT": setting.removeprefix("auto-spin") or "300000"}
    return {}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--requests", type=int, default=26)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--pin", type=int, default=None, help="CPU to pin the busy process to (default: not pinned)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--threads", default="auto,auto-passive,auto-spin,1",
                   help="comma-separated --worker-threads values (auto: the plan with the worker's waits, "
                        "worker/omp_env.py; auto-passive: the plan with threads sleeping at once, "
                        "OMP_WAIT_POLICY=PASSIVE; auto-spin: OpenMP's default spinning, GOMP_SPINCOUNT=300000; "
                        "auto-spinN: GOMP_SPINCOUNT=N)")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so each LLM stops its engine-core
    common: dict[str, object] = {"max_model_len": 1024, "max_num_batched_tokens": args.max_num_batched_tokens,
                                 "kv_cache_memory": str(1 << 30), "client_timeout": 30.0}
    settings = [Setting(f"worker-threads {t}", {} if t.startswith("auto") else {"worker_threads": int(t)},
                        wait_env(t)) for t in args.threads.split(",")]
    for s in settings:
        measure(s, args.model, args.rounds, args.requests, args.max_tokens, args.pin, common)
    print(f"\n{args.requests} requests x {args.max_tokens} tokens, budget {args.max_num_batched_tokens}, "
          f"busy process {'pinned to CPU ' + str(args.pin) if args.pin is not None else 'not pinned'}, "
          f"{os.cpu_count()} CPUs, {args.rounds} rounds alternating; medians")
    print("| worker threads | alone s (median) | busy s (median) | busy / alone, per round: median (min-max) |")
    print("|---|---|---|---|")
    for s in settings:
        alone, busy = statistics.median(s.alone), statistics.median(s.busy)
        ratios = [b / a for a, b in zip(s.alone, s.busy)]  # each round's two batches ran back to back
        print(f"| {s.name.removeprefix('worker-threads ')} | {alone:.2f} | {busy:.2f} | "
              f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) |")
    return 0
