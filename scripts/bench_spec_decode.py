"""Speculative decoding (n-gram) benchmark: output tok/s, acceptance, with speculation on and off.

Uses a tiny model that really copies (scripts/train_copy_model.py; trained on the spot when the
folder has no config.json) and two workloads sent as token ids to engine-cores started here:

* copy: COPY marker, random content, then the first tokens of a span of it; the model goes on
  copying the span (greedy), which is what prompt lookup drafts well;
* free: FREE marker and uniformly random tokens, sampled at temperature 1 (seeded): nothing
  repeats on purpose, so there is little to draft and drafts mostly fail: this shows what
  speculation costs. (A walk of a Markov chain is no good here: its tokens recur, and a model that
  learned to copy copies them.)

Each workload runs at concurrency 1, 8 and saturation (every request at once), against one engine
per setting: speculation off, on, and on without ``disable_by_batch_size`` (to show what the
load switch saves). Rounds alternate the settings' order; the table gives medians over rounds.

    python scripts/bench_spec_decode.py --model-dir /tmp/copy-model --rounds 3 --out /tmp/spec.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from evenflow.bench.copy_model import COPY, FIRST_CONTENT, FREE, VOCAB, train
from evenflow.bench.engine_proc import EngineProc

from evenflow.worker.ngram_proposer import propose_ngram
from evenflow.protocol import SamplingParams


@dataclass
class Cell:
    """One (setting, workload, concurrency) measurement."""

    setting: str
    workload: str
    concurrency: str
    seconds: float
    output_tokens: int
    draft_tokens: int
    accepted_tokens: int
    drafts: int

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """vLLM's mean acceptance length: tokens per verifying step of a request (1 + accepted)."""
        return 1 + self.accepted_tokens / self.drafts if self.drafts else 1.0


def copy_prompt(rng: np.random.Generator, content_len: int, cue: int) -> list[int]:
    content = rng.integers(FIRST_CONTENT, VOCAB, size=content_len)
    offset = int(rng.integers(0, content_len // 3))
    return [COPY, *content.tolist(), *content[offset : offset + cue].tolist()]


def workload(name: str, num: int, seed: int, max_tokens: int) -> list[tuple[list[int], SamplingParams]]:
    rng = np.random.default_rng(seed)
    if name == "copy":
        # Prompt + output stay within the 64 positions the model was trained on.
        return [(copy_prompt(rng, 30, 3), SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
                for _ in range(num)]
    return [([FREE, *rng.integers(FIRST_CONTENT, VOCAB, size=33).tolist()],
             SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed * 1000 + i, ignore_eos=True))
            for i in range(num)]


def engine_flags(spec: str | None, extra: list[str]) -> list[str]:
    """The engine-core's flags for one setting (``spec``: its --speculative-config, None: off)."""
    flags = ["--dtype", "float32", "--device", "cpu", "--max-model-len", "512", "--num-kv-blocks", "512",
             "--max-num-batched-tokens", "1024", "--max-num-seqs", "64", *extra]
    return flags + (["--speculative-config", spec] if spec else [])


async def measure(engine: EngineProc, setting: str, name: str, concurrency: str, requests: list) -> Cell:
    before = await engine.stats()
    level = len(requests) if concurrency == "sat" else int(concurrency)
    batch = await engine.run(requests, level)
    after = await engine.stats()
    return Cell(setting, name, concurrency, batch.seconds, batch.output_tokens,
                after.spec_decode.num_draft_tokens - before.spec_decode.num_draft_tokens,
                after.spec_decode.num_accepted_tokens - before.spec_decode.num_accepted_tokens,
                after.spec_decode.num_drafts - before.spec_decode.num_drafts)


async def bench(args: argparse.Namespace, settings: dict[str, str | None], workdir: Path) -> list[Cell]:
    extra = ["--worker-threads", str(args.worker_threads)] if args.worker_threads else []
    engines = {name: EngineProc(str(args.model_dir), workdir, name, engine_flags(spec, extra))
               for name, spec in settings.items()}
    cells: list[Cell] = []
    try:
        for engine in engines.values():
            await engine.start(timeout=300)
        for round_index in range(args.rounds):
            order = list(engines) if round_index % 2 == 0 else list(reversed(engines))
            for name in ("copy", "free"):
                for concurrency in args.concurrency.split(","):
                    num = args.num_requests if concurrency != "1" else max(2, args.num_requests // 2)
                    requests = workload(name, num, seed=round_index + 1, max_tokens=args.max_tokens)
                    for setting in order:
                        cell = await measure(engines[setting], setting, name, concurrency, requests)
                        cells.append(cell)
                        print(f"round {round_index} {setting:>12} {name:>5} c={concurrency:>3}: "
                              f"{cell.tok_per_s:7.1f} tok/s, acceptance {cell.acceptance_rate:.2f}, "
                              f"mean accepted length {cell.mean_accepted_length:.2f}", flush=True)
    finally:
        for engine in engines.values():
            await engine.close()
    return cells


def table(cells: list[Cell], baseline: str) -> str:
    """Markdown: medians over rounds, and each setting's speed relative to ``baseline``."""
    groups: dict[tuple[str, str, str], list[Cell]] = {}
    for c in cells:
        groups.setdefault((c.workload, c.concurrency, c.setting), []).append(c)
    lines = ["| workload | concurrency | setting | output tok/s | vs off | acceptance | mean accepted length |",
             "|---|---|---|---|---|---|---|"]
    for (name, conc, setting), group in groups.items():
        speed = statistics.median(c.tok_per_s for c in group)
        base = statistics.median(c.tok_per_s for c in groups[(name, conc, baseline)])
        lines.append(f"| {name} | {conc} | {setting} | {speed:.1f} | {speed / base:.2f}x | "
                     f"{statistics.median(c.acceptance_rate for c in group):.2f} | "
                     f"{statistics.median(c.mean_accepted_length for c in group):.2f} |")
    return "\n".join(lines)


def proposer_cost(num_requests: int = 64, lengths: tuple[int, ...] = (128, 512, 2048), repeats: int = 50) -> str:
    """Markdown: milliseconds per step of the n-gram proposer over ``num_requests`` random rows."""
    rng = np.random.default_rng(0)
    lines = [f"| tokens per request ({num_requests} requests) | min ms | median ms |", "|---|---|---|"]
    for length in lengths:
        tokens = rng.integers(0, 32000, size=(num_requests, length))
        sizes, limits = np.full(num_requests, length), np.full(num_requests, 4)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            propose_ngram(tokens, sizes, limits, 2, 4)
            times.append(time.perf_counter() - start)
        lines.append(f"| {length} | {min(times) * 1e3:.2f} | {statistics.median(times) * 1e3:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "evenflow-copy-model")
    p.add_argument("--train-steps", type=int, default=600, help="when the model has to be trained first")
    p.add_argument("--spec", default='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, '
                                     '"prompt_lookup_max": 4, "disable_by_batch_size": 16}')
    p.add_argument("--no-load-switch", action="store_true", help="skip the setting without disable_by_batch_size")
    p.add_argument("--concurrency", default="1,8,sat", help="comma list; sat = every request at once")
    p.add_argument("--num-requests", type=int, default=32, help="per cell (half of it at concurrency 1)")
    p.add_argument("--max-tokens", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--worker-threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=None, help="write every cell as JSON")
    args = p.parse_args(argv)
    if not (args.model_dir / "config.json").is_file():
        print(f"training the copy model into {args.model_dir} ({args.train_steps} steps)", flush=True)
        train(args.model_dir, args.train_steps)
    settings: dict[str, str | None] = {"off": None, "ngram": args.spec}
    spec = json.loads(args.spec)
    if not args.no_load_switch and spec.get("disable_by_batch_size") is not None:
        settings["ngram-always"] = json.dumps({**spec, "disable_by_batch_size": None})  # null: never
    with tempfile.TemporaryDirectory(prefix="bench-spec-") as tmp:
        cells = asyncio.run(bench(args, settings, Path(tmp)))
    print(f"\nspeculative config: {args.spec}\n")
    print(table(cells, "off"))
    print(f"\nn-gram proposer (K=4, n in [2, 4]), per step:\n\n{proposer_cost()}")
    if args.out:
        args.out.write_text(json.dumps([asdict(c) | {"tok_per_s": c.tok_per_s} for c in cells], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
