"""How fast a frontend's client notices a SIGKILLed engine-core (and so leaves it out of routing),
over ipc:// and tcp://, a few rounds each. Prints a table of the times from the kill.

    python scripts/bench_death_notice.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from evenflow.bench.chaos_procs import Fleet, Proc, free_port  # noqa: E402
from evenflow.frontend.clients.engine_client import EngineClient, EngineError  # noqa: E402
from evenflow.frontend.demo_model import ensure_demo_model  # noqa: E402
from evenflow.protocol import SamplingParams  # noqa: E402

FLAGS = ["--max-model-len", "1024", "--num-kv-blocks", "128", "--max-num-batched-tokens", "64", "--worker-threads", "1"]


async def one_round(model: str, address: str, work: Path) -> float:
    fleet = Fleet()
    engine = fleet.add(Proc("engine-core", ["-m", "evenflow.core.cli", "--model", model, "--listen", address, *FLAGS],
                            work / "engine.log"))
    client = EngineClient(address, "notice")
    try:
        await client.connect(timeout=180)
        killed_at = 0.0
        try:
            async for _ in client.generate("r", [3, 4, 5], SamplingParams(max_tokens=900, ignore_eos=True)):
                if not killed_at:
                    engine.signal(signal.SIGKILL)
                    killed_at = time.monotonic()
        except EngineError:
            pass
        return time.monotonic() - killed_at
    finally:
        await client.close()
        fleet.kill_leftovers()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="evenflow-notice-"))
    model = str(ensure_demo_model(work / "demo-model"))
    rows = []
    for transport in ("ipc", "tcp"):
        times = []
        for i in range(args.rounds):
            address = f"ipc://{work}/engine-{i}.sock" if transport == "ipc" else f"tcp://127.0.0.1:{free_port()}"
            times.append(asyncio.run(one_round(model, address, work)))
            print(f"{transport} round {i}: {times[-1] * 1000:.1f} ms", flush=True)
        rows.append((transport, times))
    print("\n| transport | rounds | kill -> engine_dead, median (ms) | max (ms) |\n|---|---|---|---|")
    for transport, times in rows:
        print(f"| {transport} | {len(times)} | {statistics.median(times) * 1000:.1f} | {max(times) * 1000:.1f} |")


if __name__ == "__main__":
    main()
