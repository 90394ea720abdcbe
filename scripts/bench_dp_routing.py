"""Data-parallel routing: prefix-aware vs round-robin vs load-only, two engine-cores on this host.

    python scripts/bench_dp_routing.py                      # the demo model, 2 rounds, ~3 minutes
    python scripts/bench_dp_routing.py --smoke --model DIR  # seconds (the test suite runs this)

Starts two engine-cores (one CPU each when there are two, ``--worker-threads 1``) and drives them
through one DataParallelClient (the frontend's own router, without HTTP) with many multi-turn
conversations that share a few system prompts: each turn's prompt is the system prompt, the whole
history (earlier prompts and the engine's answers) and a new user message. Conversations run
``--concurrency`` at a time, turns of one conversation in order. Each policy starts from empty
prefix caches; rounds alternate the policy order, since this machine's noise is as large as the
gaps. Reports the engines' prefix-cache hit rate (hit tokens / looked-up tokens, from their
stats), TTFT p50/p99 and throughput, per round and as medians.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from evenflow.bench.server import evenflow_process_env
from evenflow.frontend.clients.data_parallel import DataParallelClient
from evenflow.frontend.clients.router import ROUTING_POLICIES, RoutingConfig
from evenflow.protocol import SamplingParams, SchedulerStats


@dataclass
class Result:
    policy: str
    round: int
    hit_rate: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    requests_per_s: float
    output_tokens_per_s: float
    balance_share: float  # fraction of routing decisions made by the hot-spot guard
    busiest_share: float  # the busier engine-core's share of the generated tokens


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder (default: the built-in demo model)")
    p.add_argument("--policies", default=",".join(("prefix", "round_robin", "load")))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-prompts", type=int, default=4)
    p.add_argument("--system-len", type=int, default=384, help="tokens per shared system prompt")
    p.add_argument("--user-len", type=int, default=48, help="tokens per user message")
    p.add_argument("--output-len", type=int, default=16, help="tokens per answer (greedy, no EOS)")
    p.add_argument("--concurrency", type=int, default=8, help="conversations in flight at once")
    p.add_argument("--num-kv-blocks", type=int, default=192, help="per engine-core (16-token blocks)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--balance-abs", type=float, default=RoutingConfig().balance_abs_threshold,
                   help="the frontend's --routing-balance-abs-threshold")
    p.add_argument("--balance-rel", type=float, default=RoutingConfig().balance_rel_threshold,
                   help="the frontend's --routing-balance-rel-threshold")
    p.add_argument("--smoke", action="store_true", help="a few seconds: tiny workload, one round")
    args = p.parse_args(argv)
    if args.smoke:
        args.rounds, args.conversations, args.turns, args.system_prompts = 1, 6, 2, 2
        args.system_len, args.user_len, args.output_len, args.concurrency = 48, 8, 4, 3
    for policy in args.policies.split(","):
        if policy not in ROUTING_POLICIES:
            p.error(f"unknown policy {policy!r} (known: {', '.join(ROUTING_POLICIES)})")
    return args


def start_engines(model: str, workdir: Path, args: argparse.Namespace) -> list[subprocess.Popen]:
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    max_len = args.system_len + args.turns * (args.user_len + args.output_len) + 16
    procs = []
    for i in range(2):
        cmd = [sys.executable, "-m", "evenflow.core", "--model", model, "--listen", f"ipc://{workdir}/e{i}.sock",
               "--worker-threads", "1", "--num-kv-blocks", str(args.num_kv_blocks), "--max-model-len",
               str(max_len), "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--max-num-seqs", "32"]
        pin = {cpus[i]} if len(cpus) >= 2 else None
        log = open(workdir / f"e{i}.log", "wb")
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      env=evenflow_process_env(),
                                      preexec_fn=(lambda pin=pin: os.sched_setaffinity(0, pin)) if pin else None))
    return procs


async def run_policy(addresses: list[str], policy: str, round_index: int, args: argparse.Namespace) -> Result:
    client = DataParallelClient(addresses, f"bench-{policy}", RoutingConfig(policy, args.balance_abs, args.balance_rel))
    ready = await client.connect(timeout=300)
    await client.call_utility("reset_prefix_cache")
    await asyncio.sleep(0.2)  # the engines' "cleared" reports reach the client before we start
    before = (await client.call_utility("get_stats")).result
    before_per_engine = client.engine_stats()
    rng = random.Random(args.seed)  # the same workload for every policy and round
    vocab = ready.vocab_size
    systems = [[rng.randrange(vocab) for _ in range(args.system_len)] for _ in range(args.system_prompts)]
    users = [[[rng.randrange(vocab) for _ in range(args.user_len)] for _ in range(args.turns)]
             for _ in range(args.conversations)]
    ttfts: list[float] = []
    output_tokens = 0
    gate = asyncio.Semaphore(args.concurrency)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)

    async def conversation(c: int) -> None:
        nonlocal output_tokens
        history = list(systems[c % args.system_prompts])
        async with gate:
            for t in range(args.turns):
                history += users[c][t]
                start, first = time.perf_counter(), None
                async for out in client.generate(f"c{c}t{t}", history, params):
                    if out.new_token_ids and first is None:
                        first = time.perf_counter()
                    history += out.new_token_ids
                    output_tokens += len(out.new_token_ids)
                ttfts.append((first or time.perf_counter()) - start)

    t0 = time.perf_counter()
    await asyncio.gather(*(conversation(c) for c in range(args.conversations)))
    wall = time.perf_counter() - t0
    after = (await client.call_utility("get_stats")).result
    generated = [after_e.scheduler.num_generation_tokens - before_per_engine[k].scheduler.num_generation_tokens
                 for k, after_e in client.engine_stats().items()]
    decisions = dict(client.decisions)
    await client.close()
    assert isinstance(before, SchedulerStats) and isinstance(after, SchedulerStats)
    queries = after.kv_cache.prefix_cache_queries - before.kv_cache.prefix_cache_queries
    hits = after.kv_cache.prefix_cache_hits - before.kv_cache.prefix_cache_hits
    ms = np.array(ttfts) * 1000
    return Result(policy, round_index, hits / max(1, queries), float(np.percentile(ms, 50)),
                  float(np.percentile(ms, 99)), len(ttfts) / wall, output_tokens / wall,
                  decisions.get("balance", 0) / max(1, sum(decisions.values())), max(generated) / max(1, sum(generated)))


def table(results: list[Result]) -> str:
    rows = ["| policy | round | prefix-cache hit rate | TTFT p50 ms | TTFT p99 ms | requests/s | output tok/s "
            "| hot-spot guard | busiest engine |", "|---|--:|--:|--:|--:|--:|--:|--:|--:|"]
    policies = list(dict.fromkeys(r.policy for r in results))
    rounds = sorted({r.round for r in results})
    groups = [(p, [r for r in results if r.policy == p]) for p in policies]
    for policy, rs in groups:
        for r in rs:
            rows.append(f"| {policy} | {r.round} | {r.hit_rate:.1%} | {r.ttft_p50_ms:.0f} | {r.ttft_p99_ms:.0f} | "
                        f"{r.requests_per_s:.2f} | {r.output_tokens_per_s:.1f} | {r.balance_share:.0%} | "
                        f"{r.busiest_share:.0%} |")
    if len(rounds) > 1:
        for policy, rs in groups:
            med = {f: statistics.median(getattr(r, f) for r in rs) for f in
                   ("hit_rate", "ttft_p50_ms", "ttft_p99_ms", "requests_per_s", "output_tokens_per_s", "balance_share",
                    "busiest_share")}
            rows.append(f"| **{policy}** | median | {med['hit_rate']:.1%} | {med['ttft_p50_ms']:.0f} | "
                        f"{med['ttft_p99_ms']:.0f} | {med['requests_per_s']:.2f} | {med['output_tokens_per_s']:.1f} | "
                        f"{med['balance_share']:.0%} | {med['busiest_share']:.0%} |")
    return "\n".join(rows)


async def run_all(addresses: list[str], args: argparse.Namespace) -> list[Result]:
    policies = args.policies.split(",")
    results = []
    for r in range(args.rounds):
        order = policies if r % 2 == 0 else policies[::-1]
        for policy in order:
            res = await run_policy(addresses, policy, r, args)
            print(f"round {r} {policy}: hit {res.hit_rate:.1%}, TTFT p50 {res.ttft_p50_ms:.0f} ms, "
                  f"p99 {res.ttft_p99_ms:.0f} ms, {res.requests_per_s:.2f} req/s", flush=True)
            results.append(res)
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = args.model
    if model is None:
        from evenflow.frontend.demo_model import ensure_demo_model

        model = str(ensure_demo_model())
    workdir = Path(tempfile.mkdtemp(prefix="bench-dp-"))
    procs = start_engines(model, workdir, args)
    try:
        results = asyncio.run(run_all([f"ipc://{workdir}/e{i}.sock" for i in range(2)], args))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    print(f"\n{args.conversations} conversations x {args.turns} turns, {args.system_prompts} system prompts of "
          f"{args.system_len} tokens, user {args.user_len} / answer {args.output_len} tokens, concurrency "
          f"{args.concurrency}, 2 engine-cores x {args.num_kv_blocks} KV blocks\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
