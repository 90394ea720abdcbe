#!/usr/bin/env python3
"""Load generator for any OpenAI-compatible server (evenflow, vLLM): streaming, seeded, bounded.

Examples (the server must already run; ``sweep_budget.py`` and ``bench_peer.py`` start their own):

    # 8 steady streams (128 in / 256 out) + a 2048-token prompt every 5 s, for 60 s
    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 --workload interference \\
        --duration 60 --model-dir /tmp/small --out interference.json

    # Poisson arrivals at 2 req/s, lognormal lengths up to 4k-token prompts, SLOs for goodput
    python scripts/bench_serving.py --workload poisson --rate 2 --duration 60 \\
        --slo-ttft-ms 2000 --slo-itl-ms 250 --out poisson.json

Prints a table (TTFT, TPOT, ITL, e2e: p50/p95/p99/p99.9/max; throughputs; goodput) per request
kind, and the engine's own counters from ``/metrics``; writes the same as JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path


import msgspec
from evenflow.bench.client import ModelInfo, fetch_model_info
from evenflow.bench.runner import BenchResult, RunOptions, run_workload
from evenflow.bench.stats import SLO, format_table
from evenflow.bench.workload import Workload, add_workload_args, fit_lengths, workload_from_args

DEFAULT_VOCAB_SIZE = 1000  # safe for any real vocabulary when nothing better is known


def add_run_args(parser: argparse.ArgumentParser, standalone: bool = True) -> None:
    """Flags for how a run is made (SLOs, output), shared by the other scripts; ``standalone`` adds
    the server's address, checkpoint and ``--out``, which the scripts that launch servers define themselves."""
    g = parser.add_argument_group("run")
    if standalone:
        g.add_argument("--base-url", default="http://127.0.0.1:8000")
        g.add_argument("--model-dir", type=Path, default=None, help="checkpoint folder (for vocab_size)")
    g.add_argument("--model", default=None, help="model name in requests (default: first of /v1/models)")
    g.add_argument("--slo-ttft-ms", type=float, default=None)
    g.add_argument("--slo-tpot-ms", type=float, default=None)
    g.add_argument("--slo-itl-ms", type=float, default=None, help="a request's worst inter-token gap")
    g.add_argument("--slo-e2e-ms", type=float, default=None)
    g.add_argument("--request-timeout", type=float, default=600.0)
    g.add_argument("--drain-timeout", type=float, default=60.0, help="after the window; then cancel")
    g.add_argument("--warmup-requests", type=int, default=2)
    g.add_argument("--metrics-interval", type=float, default=1.0, help="seconds between /metrics polls")
    g.add_argument("--no-progress", action="store_true")
    if standalone:  # the scripts that launch servers write into their --out-dir
        g.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    g.add_argument("--save-requests", action="store_true",
                   help="keep every request record (with --out; sweep_budget.py and bench_peer.py: in --out-dir)")


def options_from_args(args: argparse.Namespace, base_url: str | None = None) -> RunOptions:
    slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_itl_ms, args.slo_e2e_ms)
    return RunOptions(
        base_url=base_url or args.base_url,
        model=args.model,
        slo=slo,
        request_timeout_s=args.request_timeout,
        drain_timeout_s=args.drain_timeout,
        warmup_requests=args.warmup_requests,
        metrics_interval_s=args.metrics_interval,
        progress=not args.no_progress,
    )


def vocab_size_of(model_dir: Path | None) -> int | None:
    """``vocab_size`` from a checkpoint's config.json (also under ``text_config``), if readable."""
    if model_dir is None or not (Path(model_dir) / "config.json").is_file():
        return None
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size")


def resolve_vocab_size(args: argparse.Namespace, info: ModelInfo) -> int:
    """--vocab-size, else --model-dir's config, else the served model id when it is a folder."""
    if args.vocab_size:
        return int(args.vocab_size)
    found = vocab_size_of(args.model_dir) or vocab_size_of(Path(info.id))
    return int(found or DEFAULT_VOCAB_SIZE)


def _run_async(coro):  # type: ignore[no-untyped-def]
    """asyncio.run on uvloop when installed: less client CPU per chunk."""
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


def run_benchmark(workload: Workload, opts: RunOptions) -> BenchResult:
    """Run one workload to completion (blocking) and return its result."""
    return _run_async(run_workload(workload, opts))


def format_engine(result: BenchResult) -> str:
    e = result.engine
    items = [
        ("preemptions", e.preemptions, "{:.0f}"),
        ("prefix cache hits / queries (tokens)", (e.prefix_cache_hits, e.prefix_cache_queries), "{}"),
        ("prefix hit rate", e.prefix_hit_rate, "{:.3f}"),
        ("KV cache usage peak", e.kv_usage_peak, "{:.3f}"),
        ("prompt / generation tokens", (e.prompt_tokens, e.generation_tokens), "{}"),
        ("engine steps", e.steps, "{:.0f}"),
        ("tokens per step", e.tokens_per_step, "{:.1f}"),
        ("model busy fraction", e.busy_fraction, "{:.3f}"),
        ("adaptive: target, run median (ms)", e.target_itl_ms, "{:.1f}"),
        ("adaptive: target low / high / end (ms)",
         (e.target_itl_ms_low, e.target_itl_ms_high, e.target_itl_ms_end), "{}"),
        ("adaptive: mean token budget", e.mean_token_budget, "{:.1f}"),
        ("adaptive: steps within target", e.within_target_share, "{:.3f}"),
        ("adaptive: measured / predicted time", e.measured_over_predicted, "{:.3f}"),
    ]
    lines = ["engine (from /metrics):"]
    for label, value, fmt in items:
        if isinstance(value, tuple):
            shown = "-" if all(v is None for v in value) else " / ".join("-" if v is None else f"{v:.0f}" for v in value)
        else:
            shown = "-" if value is None else fmt.format(value)
        lines.append(f"  {label:<38}{shown}")
    return "\n".join(lines)


def result_json(result: BenchResult, config: dict[str, object], keep_records: bool) -> dict[str, object]:
    """A plain-JSON view of a result (records only when asked: they are large)."""
    data = msgspec.to_builtins(result)
    if not keep_records:
        data.pop("records")
    data["config"] = config
    return data


def args_config(args: argparse.Namespace) -> dict[str, object]:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


def write_json(path: Path, payload: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.format(msgspec.json.encode(payload), indent=2))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(parser)
    add_workload_args(parser)
    args = parser.parse_args(argv)
    info = _run_async(fetch_model_info(args.base_url))
    vocab = resolve_vocab_size(args, info)
    for note in fit_lengths(args, info.max_model_len) if info.max_model_len else []:
        print(f"note: {note}")
    workload = workload_from_args(args, vocab)
    result = run_benchmark(workload, options_from_args(args))
    print(f"{workload.name} on {result.base_url} ({result.model})")
    print(format_table(result.stats))
    print(format_engine(result))
    if args.out is not None:
        write_json(args.out, result_json(result, args_config(args), args.save_requests))
        print(f"wrote {args.out}")
    failed = result.stats.groups["all"].failed if result.stats.groups else 0
    return 0 if result.stats.groups and failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
