"""The multi-LoRA benchmark: the same closed-loop load with 0, 1, 4 and 8 adapters in the mix.

One engine-core serves the real model with ``--enable-lora`` and eight adapters; ``streams``
clients each send ``requests`` requests one after another (random prompts, so no prefix hits;
greedy, ``ignore_eos``), stream i using adapter ``i % k`` (k = 0: the base model). Rounds
alternate the order of the mixes (0 1 4 8, then 8 4 1 0, ...) so the machine's drift touches each
alike. A second engine without ``--enable-lora`` runs the k = 0 load too: base-model tokens on a
LoRA engine should cost what they cost without it. Output tok/s is output tokens over the round's
wall time; ITL is every gap between a request's consecutive tokens.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from evenflow.bench.server import evenflow_process_env
from evenflow.bench.stats import dist_ms
from evenflow.frontend.clients.engine_client import EngineClient
from evenflow.protocol import AdapterRef, SamplingParams
from evenflow.protocol.lifeline import stop_processes


@dataclass
class MixRecord:
    """Every round of one mix: output tokens, seconds, inter-token gaps."""

    label: str
    tokens: int = 0
    seconds: float = 0.0
    gaps_s: list[float] = field(default_factory=list)

    def row(self, base_tok_s: float, base_p99: float) -> list[str]:
        itl = dist_ms(np.asarray(self.gaps_s))
        tok_s = self.tokens / max(self.seconds, 1e-9)
        return [self.label, f"{tok_s:.1f}", f"{tok_s / base_tok_s:.2f}", f"{itl.p50:.1f}", f"{itl.p99:.1f}",
                f"{itl.p99 / base_p99:.2f}"]


def start_engine(model: Path, address: str, log: Path, flags: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "evenflow.core.cli", "--model", str(model), "--listen", address, *flags]
    return subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
                            env=evenflow_process_env())


def stop_engine(proc: subprocess.Popen) -> None:
    stop_processes([proc], timeout=20, kill_group=True)


async def connect(address: str, timeout: float = 300.0) -> EngineClient:
    client = EngineClient(address, client_name="bench-lora")
    deadline = time.monotonic() + timeout
    while True:
        try:
            await client.connect(timeout=5.0)
            return client
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(1.0)


async def run_round(client: EngineClient, adapters: list[AdapterRef | None], streams: int, requests: int,
                    prompt_len: int, output_len: int, vocab: int, seed: int, record: MixRecord) -> None:
    """One round of the closed-loop load; adds its tokens, wall time and gaps to ``record``."""
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)

    async def stream(i: int) -> None:
        adapter = adapters[i % len(adapters)]
        for j in range(requests):
            prompt = rng.integers(100, vocab, prompt_len).tolist()
            last = None
            kwargs = {"lora": adapter} if adapter is not None else {}
            async for out in client.generate(f"s{seed}-{i}-{j}", prompt, params, **kwargs):
                now = time.perf_counter()
                if out.new_token_ids:
                    if last is not None:
                        record.gaps_s.extend([(now - last) / len(out.new_token_ids)] * len(out.new_token_ids))
                    last = now
                    record.tokens += len(out.new_token_ids)

    start = time.perf_counter()
    await asyncio.gather(*(stream(i) for i in range(streams)))
    record.seconds += time.perf_counter() - start
