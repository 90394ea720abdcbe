"""Seeded workloads for the serving benchmarks: which prompts to send, how long, and when.

Prompts are random token ids in ``[10, vocab_size - 10)`` (no tokenizer effects, no accidental
special tokens) and every request asks for ``ignore_eos`` so lengths are exactly what was asked.
Two shapes:

- ``interference``: S steady streams decode continuously (each restarts with a fresh prompt when it
  finishes) while a long prompt arrives every T seconds. Dynamic, so it is a ``SteadySpec`` plus a
  fixed schedule of long prompts.
- ``poisson``: arrivals at rate lambda with lengths from a clipped lognormal, or replayed from a
  JSONL file of ``{prompt_len, output_len, arrival}``. A fixed schedule.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FIRST_SAFE_ID = 10  # below this sit special tokens in most vocabularies


@dataclass(frozen=True)
class PlannedRequest:
    """One request of a fixed schedule: sent ``arrival_s`` after the run starts."""

    arrival_s: float
    prompt_len: int
    output_len: int
    kind: str


@dataclass(frozen=True)
class SteadySpec:
    """Streams that keep decoding for the whole run: ``count`` of them, restarted on finish."""

    count: int
    prompt_len: int
    output_len: int


@dataclass(frozen=True)
class Workload:
    """Everything a run sends: a schedule (may be empty) and steady streams (may be none)."""

    name: str
    schedule: list[PlannedRequest]
    steady: SteadySpec | None
    duration_s: float
    vocab_size: int
    seed: int
    shared_prefix_len: int = 0  # tokens every scheduled prompt starts with (prefix-cache reuse)


@dataclass(frozen=True)
class LengthDist:
    """A clipped lognormal over integer lengths; ``sigma == 0`` means every length is the median."""

    median: int
    sigma: float
    low: int
    high: int

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.sigma <= 0:
            return np.full(n, min(max(self.median, self.low), self.high), dtype=np.int64)
        raw = rng.lognormal(mean=math.log(self.median), sigma=self.sigma, size=n)
        return np.clip(np.rint(raw), self.low, self.high).astype(np.int64)


class PromptMaker:
    """Random token-id prompts; one seeded generator per stream so runs are reproducible."""

    def __init__(self, vocab_size: int, seed: int) -> None:
        if vocab_size < 2 * FIRST_SAFE_ID + 1:
            raise ValueError(f"vocab_size {vocab_size} too small for random prompts")
        self._vocab_size = vocab_size
        self._rng = np.random.default_rng(seed)

    def ids(self, n: int) -> list[int]:
        return self._rng.integers(FIRST_SAFE_ID, self._vocab_size - FIRST_SAFE_ID, n).tolist()


def poisson_schedule(
    rate: float, num_requests: int, duration_s: float, prompt: LengthDist, output: LengthDist, seed: int
) -> list[PlannedRequest]:
    """Poisson arrivals at ``rate`` per second (``inf``: all at t=0), bounded in count and time."""
    rng = np.random.default_rng(seed)
    if math.isinf(rate):
        arrivals = np.zeros(num_requests)
    else:
        arrivals = np.cumsum(rng.exponential(1.0 / rate, size=num_requests))
        arrivals = arrivals[arrivals < duration_s]
    n = len(arrivals)
    prompt_lens, output_lens = prompt.sample(rng, n), output.sample(rng, n)
    return [
        PlannedRequest(float(a), int(p), int(o), "poisson")
        for a, p, o in zip(arrivals, prompt_lens, output_lens)
    ]


def replay_schedule(path: Path, speed: float, num_requests: int, duration_s: float) -> list[PlannedRequest]:
    """Read ``{prompt_len, output_len, arrival}`` lines; arrivals are shifted to start at 0."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows.sort(key=lambda r: float(r["arrival"]))
    if not rows:
        return []
    t0 = float(rows[0]["arrival"])
    planned = [
        PlannedRequest((float(r["arrival"]) - t0) / speed, int(r["prompt_len"]), int(r["output_len"]), "replay")
        for r in rows
    ]
    return [p for p in planned if p.arrival_s < duration_s][:num_requests]


def long_prompt_schedule(
    prompt_len: int, output_len: int, interval_s: float, first_s: float, duration_s: float
) -> list[PlannedRequest]:
    """One long prompt every ``interval_s`` from ``first_s`` until the run's end."""
    times = np.arange(first_s, duration_s, interval_s) if interval_s > 0 else np.array([])
    return [PlannedRequest(float(t), prompt_len, output_len, "long") for t in times]


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The workload flags shared by bench_serving, sweep_budget and bench_peer."""
    g = parser.add_argument_group("workload")
    g.add_argument("--workload", choices=["interference", "poisson"], default="interference")
    g.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals (then drain)")
    g.add_argument("--max-requests", type=int, default=100_000, help="cap on scheduled requests")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--vocab-size", type=int, default=None, help="default: from the model's config.json")
    g.add_argument("--steady-streams", type=int, default=8)
    g.add_argument("--steady-prompt-len", type=int, default=128)
    g.add_argument("--steady-output-len", type=int, default=256)
    g.add_argument("--long-prompt-len", type=int, default=2048)
    g.add_argument("--long-output-len", type=int, default=16)
    g.add_argument("--long-interval", type=float, default=5.0, help="seconds between long prompts")
    g.add_argument("--long-first", type=float, default=2.0, help="when the first long prompt arrives")
    g.add_argument("--rate", type=float, default=1.0, help="poisson arrivals per second (inf allowed)")
    g.add_argument("--prompt-len-median", type=int, default=256)
    g.add_argument("--prompt-len-sigma", type=float, default=1.0)
    g.add_argument("--prompt-len-range", type=str, default="16:4096", help="clip range LOW:HIGH")
    g.add_argument("--output-len-median", type=int, default=128)
    g.add_argument("--output-len-sigma", type=float, default=0.6)
    g.add_argument("--output-len-range", type=str, default="4:512", help="clip range LOW:HIGH")
    g.add_argument("--shared-prefix-len", type=int, default=0, help="common prefix of poisson prompts")
    g.add_argument("--replay", type=Path, default=None, help="JSONL of {prompt_len, output_len, arrival}")
    g.add_argument("--replay-speed", type=float, default=1.0)


def fit_lengths(args: argparse.Namespace, max_model_len: int) -> list[str]:
    """Shrink prompt lengths in ``args`` so prompt + output fits ``max_model_len``; say what changed."""
    notes = []
    if args.long_prompt_len + args.long_output_len > max_model_len:
        fitted = max_model_len - args.long_output_len
        notes.append(f"long prompts {args.long_prompt_len} -> {fitted} tokens (max_model_len {max_model_len})")
        args.long_prompt_len = fitted
    if args.steady_prompt_len + args.steady_output_len > max_model_len:
        fitted = max_model_len - args.steady_output_len
        notes.append(f"steady prompts {args.steady_prompt_len} -> {fitted} tokens (max_model_len {max_model_len})")
        args.steady_prompt_len = fitted
    low, high = _range(args.prompt_len_range)
    out_high = _range(args.output_len_range)[1]
    if high + out_high > max_model_len:
        args.prompt_len_range = f"{min(low, max_model_len - out_high)}:{max_model_len - out_high}"
        notes.append(f"poisson prompt lengths clipped to {args.prompt_len_range} (max_model_len {max_model_len})")
    return notes


def _range(text: str) -> tuple[int, int]:
    low, high = text.split(":")
    return int(low), int(high)


def workload_from_args(args: argparse.Namespace, vocab_size: int, rate: float | None = None) -> Workload:
    """Build the workload the flags describe; ``rate`` overrides ``--rate`` (capacity search)."""
    if args.workload == "interference":
        steady = SteadySpec(args.steady_streams, args.steady_prompt_len, args.steady_output_len)
        schedule = long_prompt_schedule(
            args.long_prompt_len, args.long_output_len, args.long_interval, args.long_first, args.duration
        )
        return Workload("interference", schedule[: args.max_requests], steady, args.duration, vocab_size, args.seed)
    # A different seed per rate: probes of one capacity search must not hit each other's prefixes.
    seed = args.seed if rate is None else args.seed + int(rate * 1000) + 1
    if args.replay is not None:
        schedule = replay_schedule(args.replay, args.replay_speed, args.max_requests, args.duration)
    else:
        prompt = LengthDist(args.prompt_len_median, args.prompt_len_sigma, *_range(args.prompt_len_range))
        output = LengthDist(args.output_len_median, args.output_len_sigma, *_range(args.output_len_range))
        the_rate = args.rate if rate is None else rate
        schedule = poisson_schedule(the_rate, args.max_requests, args.duration, prompt, output, seed)
    return Workload(
        "poisson", schedule, None, args.duration, vocab_size, seed, shared_prefix_len=args.shared_prefix_len
    )
