#!/usr/bin/env python3
"""Overlap on vs off under a steady decode load, plus the frontend wire's cost. One run, one table.

    python scripts/bench_overlap.py [--concurrency 256] [--seconds 20] [--device auto]

1. Writes a config.json-only model folder (random weights: ``--load-format dummy``): hidden 1024,
   8 layers, 16/4 heads, ffn 2816, vocab 8192.
2. For overlap on and off: starts an engine-core, keeps ``--concurrency`` requests running (each
   finished request is replaced at once: steady arrivals), warms up, then measures over a window:
   steps/s, tokens/s, and the fraction of wall time rank 0 sat idle waiting for the engine-core
   (``worker_idle_s`` from the stats: the worker's own measure of waiting for its next step).
3. Wire cost: Outputs messages pushed through FrontendLink's ROUTER to a DEALER and decoded there,
   for a 1-request and a 256-request Outputs: messages/s and microseconds per message.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import zmq

from evenflow.core.frontend_link import FrontendLink
from evenflow.frontend.clients.engine_client import EngineClient, EngineError
from evenflow.protocol.lifeline import stop_processes
from evenflow.protocol import (
    PROTOCOL_VERSION, Abort, Codec, EngineToFrontend, Hello, Outputs, Ready, RequestOutput, SamplingParams,
    SchedulerCounts,
    SchedulerStats,
)

BASE_CONFIG = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=8192, max_position_embeddings=4096,
    rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    torch_dtype="float32",
)
# "small" is the issue's model; "tiny" makes the engine-core's own cost visible on a CPU, where the
# small model's forward pass dwarfs everything else.
PRESETS = {
    "small": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                  num_key_value_heads=4),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
}
PROMPT_LEN, MAX_TOKENS, MAX_MODEL_LEN = 32, 160, 256


def write_model(root: Path, preset: str) -> Path:
    """A config.json-only model folder (weights are drawn by the workers: --load-format dummy)."""
    folder = root / f"bench-llama-{preset}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(BASE_CONFIG | PRESETS[preset], indent=2))
    return folder


async def _keep_busy(client: EngineClient, concurrency: int, stop: asyncio.Event) -> None:
    """Closed loop: ``concurrency`` streams, each restarted with a fresh request when it ends."""
    ids = itertools.count()
    rng = random.Random(0)

    async def stream() -> None:
        while not stop.is_set():
            prompt = [rng.randrange(3, 8192) for _ in range(PROMPT_LEN)]
            sp = SamplingParams(max_tokens=rng.randrange(MAX_TOKENS // 2, MAX_TOKENS), temperature=0.0,
                                ignore_eos=True)
            agen = client.generate(f"b{next(ids)}", prompt, sp)
            try:
                async for _ in agen:
                    if stop.is_set():
                        break
            finally:
                await agen.aclose()

    await asyncio.gather(*(stream() for _ in range(concurrency)))


async def _measure(address: str, concurrency: int, warmup: float, seconds: float) -> dict[str, float]:
    client = EngineClient(address, "bench")
    await client.connect(timeout=300)
    stop = asyncio.Event()
    load = asyncio.ensure_future(_keep_busy(client, concurrency, stop))
    await asyncio.sleep(warmup)
    s0: SchedulerStats = (await client.call_utility("get_stats")).result
    t0 = time.monotonic()
    await asyncio.sleep(seconds)
    s1: SchedulerStats = (await client.call_utility("get_stats")).result
    wall = time.monotonic() - t0
    stop.set()
    try:
        await asyncio.wait_for(load, 60)
    except (asyncio.TimeoutError, EngineError):
        load.cancel()
    await client.close()
    steps = s1.scheduler.num_steps - s0.scheduler.num_steps
    return dict(
        steps_per_s=steps / wall,
        tokens_per_s=(s1.scheduler.num_generation_tokens - s0.scheduler.num_generation_tokens) / wall,
        running=s1.scheduler.num_running,
        idle_frac=(s1.workers.idle_s - s0.workers.idle_s) / wall,
        forward_ms=1e3 * (s1.workers.forward_s - s0.workers.forward_s) / max(steps, 1),
        step_ms=1e3 * wall / max(steps, 1),
        sched_ms=1e3 * ((s1.scheduler.schedule_s - s0.scheduler.schedule_s)
                        + (s1.scheduler.update_s - s0.scheduler.update_s)) / max(steps, 1),
    )


def run_engine_case(model: Path, workdir: Path, overlap: bool, args: argparse.Namespace) -> dict[str, float]:
    address = f"ipc://{workdir}/bench-{int(overlap)}.sock"
    num_blocks = args.concurrency * (MAX_MODEL_LEN // 16) + 64
    cmd = [sys.executable, "-m", "evenflow.core", "--model", str(model), "--listen", address,
           "--load-format", "dummy", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs",
           str(args.concurrency), "--max-num-batched-tokens", "2048", "--num-kv-blocks", str(num_blocks),
           "--device", args.device]
    if not overlap:
        cmd.append("--no-async-scheduling")
    log = open(workdir / f"engine-{int(overlap)}.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        return asyncio.run(_measure(address, args.concurrency, args.warmup, args.seconds))
    finally:
        stop_processes([proc], timeout=30)
        log.close()


def wire_cost(workdir: Path, outputs_per_msg: int, n_msgs: int) -> tuple[float, float]:
    """(messages/s, µs per message) for Outputs of ``outputs_per_msg`` one-token deltas."""
    ctx = zmq.Context()
    ready = Ready(PROTOCOL_VERSION, "m", "/m", 2048, 8192, [2], 16, 1024, 2048, "bench")
    link = FrontendLink(ctx, f"ipc://{workdir}/wire.sock", ready, max_frame_bytes=1 << 26, client_timeout=60)
    link.start()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"ipc://{workdir}/wire.sock")
    codec: Codec[EngineToFrontend] = Codec(EngineToFrontend)
    dealer.send(codec.encode(Hello(PROTOCOL_VERSION, "wire")))
    codec.decode(dealer.recv())
    # The Hello registered us; an Abort of nothing reaches the inbox and tells us our identity.
    dealer.send(codec.encode(Abort(["x"])))
    identity = link.inbox.get(timeout=5).identity
    stats = SchedulerStats(scheduler=SchedulerCounts(num_running=outputs_per_msg))
    msg = Outputs([RequestOutput(f"r{i}", [i % 8192]) for i in range(outputs_per_msg)], stats, time.time())
    t0 = time.perf_counter()
    for _ in range(n_msgs):
        link.send(identity, msg)
    for _ in range(n_msgs):
        codec.decode(dealer.recv())
    dt = time.perf_counter() - t0
    dealer.close(0)
    link.close()
    ctx.term()
    return n_msgs / dt, 1e6 * dt / n_msgs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=256, help="requests kept running")
    ap.add_argument("--seconds", type=float, default=20.0, help="measurement window per case")
    ap.add_argument("--warmup", type=float, default=10.0, help="seconds before measuring")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="small", help="model size")
    ap.add_argument("--skip-engine", action="store_true", help="only measure the wire")
    ap.add_argument("--wire-messages", type=int, default=20000,
                    help="1-output messages timed through the wire (a tenth as many 256-output ones)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)  # the wire test's disconnects are expected
    with tempfile.TemporaryDirectory(prefix="bench-overlap-") as tmp:
        workdir = Path(tmp)
        model = write_model(workdir, args.preset)
        rows = []
        if not args.skip_engine:
            for overlap in (True, False):
                r = run_engine_case(model, workdir, overlap, args)
                rows.append((overlap, r))
        p = PRESETS[args.preset]
        print(f"\n## overlap, {args.concurrency} requests kept running (model {args.preset}: hidden "
              f"{p['hidden_size']}, {p['num_hidden_layers']} layers, dummy weights, device {args.device})\n")
        print("| overlap | steps/s | tokens/s | running | step ms | forward ms | sched+update ms | worker idle |")
        print("|---|---|---|---|---|---|---|---|")
        for overlap, r in rows:
            print(f"| {'on' if overlap else 'off'} | {r['steps_per_s']:.2f} | {r['tokens_per_s']:.0f} | "
                  f"{r['running']:.0f} | {r['step_ms']:.1f} | {r['forward_ms']:.1f} | {r['sched_ms']:.2f} | "
                  f"{100 * r['idle_frac']:.2f}% |")
        print("\n## wire: Outputs through ROUTER -> DEALER (encode thread + IO thread + client decode)\n")
        print("| outputs per message | messages/s | µs per message |")
        print("|---|---|---|")
        for per_msg, n in ((1, args.wire_messages), (256, max(args.wire_messages // 10, 1))):
            rate, us = wire_cost(workdir, per_msg, n)
            print(f"| {per_msg} | {rate:.0f} | {us:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
