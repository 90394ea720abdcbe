"""Offline prefill and decode speed of llama.cpp's ``llama-batched-bench`` and evenflow's offline
``LLM`` on the same GGUF: B sequences of ``prompt`` tokens each generating ``gen`` tokens at once.

llama.cpp reports prefill (S_PP) and decode (S_TG) tokens per second itself. For evenflow the same
two figures come from two greedy runs of the same B prompts: ``max_tokens=1`` (the prefill and one
sampled token: prefill tok/s = B * prompt / t1) and ``max_tokens=gen`` (decode tok/s =
B * (gen - 1) / (t_gen - t1)), each the best of ``repeats``; every run goes through the engine-core
and worker processes, as a user's ``LLM.generate`` does. Prefix caching is off, as
llama-batched-bench starts each run from an empty KV cache: with it on, the runs after the first
would prefill only each prompt's last block, and decode after a prefix hit.
"""

from __future__ import annotations

import random
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SpeedRow:
    engine: str
    batch: int
    prefill_tok_s: float
    decode_tok_s: float


_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|" + r"\s*([\d.]+)\s*\|" * 6)


def parse_batched_bench(stdout: str) -> list[tuple[int, float, float]]:
    """(B, S_PP t/s, S_TG t/s) of every row of ``llama-batched-bench``'s table
    (| PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |)."""
    rows = []
    for line in stdout.splitlines():
        m = _ROW.match(line.strip())
        if m:
            rows.append((int(m.group(3)), float(m.group(6)), float(m.group(8))))
    return rows


def llamacpp_row(binary: Path, model: str, batch: int, prompt: int, gen: int, threads: int) -> SpeedRow:
    cmd = [str(binary), "-m", model, "-c", str(max(16384, batch * (prompt + gen))), "-b", "2048", "-ub", "512",
           "-npp", str(prompt), "-ntg", str(gen), "-npl", str(batch), "-t", str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    rows = parse_batched_bench(proc.stdout)
    if proc.returncode or not rows:
        raise RuntimeError(f"{' '.join(cmd)}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    b, pp, tg = rows[-1]
    return SpeedRow("llama.cpp", b, pp, tg)


def evenflow_row(model: str, batch: int, prompt: int, gen: int, threads: int, repeats: int = 2,
                 engine_args: dict[str, object] | None = None) -> SpeedRow:
    from evenflow.frontend.llm import LLM, SamplingParams

    kv = 2 * batch * (prompt + gen + 16) * 30 * 2 * 3 * 64 * 4  # SmolLM2-sized KV with room
    args: dict[str, object] = {"no_enable_prefix_caching": True, **(engine_args or {})}
    llm = LLM(model, worker_threads=threads, kv_cache_memory=max(kv, 64 << 20), max_model_len=prompt + gen + 16,
              max_num_seqs=max(batch, 1), **args)
    try:
        rng = random.Random(batch)
        prompts = [[rng.randrange(100, 40000) for _ in range(prompt)] for _ in range(batch)]

        def run(n: int) -> float:
            t0 = time.perf_counter()
            llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False)
            return time.perf_counter() - t0

        run(2)  # warm-up
        t1 = min(run(1) for _ in range(repeats))
        t_gen = min(run(gen) for _ in range(repeats))
    finally:
        llm.shutdown()
    return SpeedRow("evenflow", batch, batch * prompt / t1, batch * (gen - 1) / max(t_gen - t1, 1e-9))


def format_rows(rows: list[SpeedRow]) -> str:
    """One line per batch size: both engines' medians and evenflow / llama.cpp."""
    lines = ["| B | llama.cpp prefill tok/s | evenflow prefill tok/s | llama.cpp decode tok/s | "
             "evenflow decode tok/s | decode evenflow / llama.cpp |", "|--:|--:|--:|--:|--:|--:|"]
    for b in sorted({r.batch for r in rows}):
        by = {e: [r for r in rows if r.batch == b and r.engine == e] for e in ("llama.cpp", "evenflow")}
        med = {e: (_median([r.prefill_tok_s for r in rs]), _median([r.decode_tok_s for r in rs]))
               for e, rs in by.items()}
        ratio = med["evenflow"][1] / med["llama.cpp"][1] if med["llama.cpp"][1] else float("nan")
        lines.append(f"| {b} | {med['llama.cpp'][0]:.0f} | {med['evenflow'][0]:.0f} | {med['llama.cpp'][1]:.1f} | "
                     f"{med['evenflow'][1]:.1f} | {ratio:.2f} |")
    return "\n".join(lines)


def _median(values: list[float]) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2
