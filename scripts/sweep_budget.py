#!/usr/bin/env python3
"""Sweep ``max_num_batched_tokens``: one server per budget, the same seeded workload on each.

Draws the four curves of the budget (TTFT p50/p99, ITL p99/max, throughput, tokens per step and
model-busy fraction) as one PNG and prints a table; ``--targets`` adds evenflow's adaptive budget
(``--target-itl-ms``, the budget then an upper bound of max_model_len; ``auto``: the target the engine
derives, under its default ceiling, as a user gets it), one run per target, drawn as stars on the same
figure; ``--capacity`` adds, per budget, the highest
Poisson rate that keeps P99 ITL and P99 TTFT under ``--slo-itl-ms`` / ``--slo-ttft-ms``. The script
starts and stops each server itself on a free 127.0.0.1 port, one at a time.

    python scripts/sweep_budget.py --model-dir /tmp/small --budgets 64,128,256,512,1024,2048,unchunked \\
        --workload interference --duration 40 --out-dir bench_results/sweep

    python scripts/sweep_budget.py --model-dir /tmp/small --budgets 32,64,unchunked --targets 150,auto \\
        --workload interference --duration 40 --out-dir bench_results/sweep_adaptive

    python scripts/sweep_budget.py --model-dir /tmp/small --budgets 256,unchunked --capacity \\
        --slo-itl-ms 100 --slo-ttft-ms 3000 --capacity-duration 30 --out-dir bench_results/capacity
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path


from evenflow.bench.capacity import Capacity, Probe, meets_slo, search_capacity
from evenflow.bench.launch import add_server_args, fit_to_model, parse_budgets, server_config, server_spec
from evenflow.bench.metrics import EngineNumbers
from evenflow.bench.plot import CurvePoint, plot_budget_curves
from evenflow.bench.runner import RunOptions
from evenflow.bench.server import ManagedServer, exit_on_sigterm
from evenflow.bench.stats import RunStats, format_table
from evenflow.bench.verdict import Result, run_result, verdict_lines
from evenflow.bench.workload import add_workload_args, workload_from_args
from evenflow.bench.serving import (
    DEFAULT_VOCAB_SIZE,
    add_run_args,
    args_config,
    format_engine,
    options_from_args,
    result_json,
    run_benchmark,
    vocab_size_of,
    write_json,
)


@dataclass
class SweepPoint:
    """One budget: its run, the engine's numbers, and its capacity when asked."""

    label: str
    budget: int
    stats: RunStats | None
    engine: EngineNumbers | None
    capacity: Capacity | None = None
    error: str = ""


def measure_budget(args: argparse.Namespace, budget: int | None, vocab: int,
                   target_itl_ms: str | None = None, default: bool = False) -> SweepPoint:
    """Start the server for ``budget`` (or ``target_itl_ms``, or no budget flag at all: ``default``), run
    the workload (and the capacity search), stop it."""
    cfg = dataclasses.replace(server_config(args, budget), target_itl_ms=target_itl_ms, default_budget=default)
    spec = server_spec(args, args.engine, cfg)
    print(f"\n=== {args.engine} budget {cfg.label}: {' '.join(spec.argv)}", flush=True)
    try:
        with ManagedServer(spec):
            opts = options_from_args(args, spec.base_url)
            result = run_benchmark(workload_from_args(args, vocab), opts)
            if args.save_requests:
                path = args.out_dir / f"requests_{cfg.label}.json"
                write_json(path, result_json(result, args_config(args), keep_records=True))
                print(f"wrote {path}")
            print(format_table(result.stats))
            print(format_engine(result))
            capacity = None
            if args.capacity:
                capacity = capacity_of(args, opts, vocab)
                print(f"capacity at budget {cfg.label}: {capacity.rate:.3f} req/s")
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"budget {cfg.label} failed: {exc}", flush=True)
        return SweepPoint(cfg.label, cfg.effective_budget, None, None, None, str(exc))
    return SweepPoint(cfg.label, cfg.effective_budget, result.stats, result.engine, capacity)


def capacity_of(args: argparse.Namespace, opts: RunOptions, vocab: int) -> Capacity:
    """Binary search of the Poisson rate on the running server (no warm-up between probes)."""
    probe_args = argparse.Namespace(**vars(args))
    probe_args.workload = "poisson"
    probe_args.duration = args.capacity_duration
    opts.warmup_requests = 0

    def probe_at(rate: float) -> Probe:
        result = run_benchmark(workload_from_args(probe_args, vocab, rate=rate), opts)
        probe = meets_slo(result.stats, opts.slo)
        verdict = "meets" if probe.ok else "misses"
        print(f"  rate {rate:.3f}: ITL p99 {probe.itl_p99_ms:.1f} ms, TTFT p99 {probe.ttft_p99_ms:.1f} ms"
              f", failed {probe.failed_requests} -> {verdict} the SLO", flush=True)
        return probe

    return search_capacity(probe_at, args.capacity_rate_start, args.capacity_max_rate, args.capacity_iters)


def curve_point(p: SweepPoint, ttft_group: str, itl_group: str) -> CurvePoint | None:
    if p.stats is None or p.engine is None:
        return None
    g = p.stats.groups
    ttft, itl, total = g.get(ttft_group, g["all"]), g.get(itl_group, g["all"]), g["all"]
    return CurvePoint(
        p.label, p.label.startswith("target"), ttft.ttft.p50, ttft.ttft.p99, itl.itl.p99, itl.itl.max, total.total_throughput,
        total.output_throughput, p.engine.tokens_per_step, p.engine.busy_fraction,
        p.capacity.rate if p.capacity else None, p.label == "default",
    )


def verdict_results(points: list[SweepPoint], ttft_group: str, itl_group: str) -> list[Result]:
    """The runs as the adaptive bar judges them (evenflow/bench/verdict.py)."""
    out = []
    for p in points:
        if p.stats is None:
            continue
        g = p.stats.groups
        t, i = g.get(ttft_group, g["all"]), g.get(itl_group, g["all"])
        out.append(run_result(p.label, p.engine.target_itl_ms if p.engine is not None else None, t.ttft.p50,
                              i.itl.p99, i.itl.p999, g["all"].total_throughput))
    return out


def summary_table(points: list[SweepPoint], ttft_group: str, itl_group: str) -> str:
    head = (f"{'budget':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'p99.9':>8}"
            f" {'ITL max':>8} {'tok/s':>8} {'out tok/s':>9} {'tok/step':>8} {'busy':>5} {'capacity':>8}")
    lines = [f"(TTFT of '{ttft_group}' requests, ITL of '{itl_group}' requests, ms)", head]
    for p in points:
        if p.stats is None or p.engine is None:
            lines.append(f"{p.label:>10}  failed: {p.error[:80]}")
            continue
        g = p.stats.groups
        t, i, a = g.get(ttft_group, g["all"]), g.get(itl_group, g["all"]), g["all"]
        tps = "-" if p.engine.tokens_per_step is None else f"{p.engine.tokens_per_step:.1f}"
        busy = "-" if p.engine.busy_fraction is None else f"{p.engine.busy_fraction:.2f}"
        cap = "-" if p.capacity is None else f"{p.capacity.rate:.3f}"
        lines.append(
            f"{p.label:>10} {t.ttft.p50:9.1f} {t.ttft.p99:9.1f} {i.itl.p50:8.1f} {i.itl.p99:8.1f} {i.itl.p999:8.1f}"
            f" {i.itl.max:8.1f} {a.total_throughput:8.1f} {a.output_throughput:9.1f} {tps:>8} {busy:>5} {cap:>8}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_args(parser)
    add_run_args(parser, standalone=False)
    add_workload_args(parser)
    g = parser.add_argument_group("sweep")
    g.add_argument("--budgets", default="64,128,256,512,1024,2048,4096,8192,unchunked")
    g.add_argument("--targets", default="",
                   help="comma list of --target-itl-ms values (ms, or auto: the target the engine derives): adaptive runs (evenflow)")
    g.add_argument("--default", action="store_true",
                   help="also run the engine with no budget flag (evenflow: the target it derives), marked on the figure")
    g.add_argument("--reverse", action="store_true", help="run in reverse order (alternate rounds with it)")
    g.add_argument("--engine", choices=["evenflow", "vllm"], default="evenflow")
    g.add_argument("--out-dir", type=Path, default=Path("bench_results/sweep"))
    g.add_argument("--capacity", action="store_true", help="also search each budget's capacity")
    g.add_argument("--capacity-duration", type=float, default=30.0, help="seconds of arrivals per probe")
    g.add_argument("--capacity-rate-start", type=float, default=0.5)
    g.add_argument("--capacity-max-rate", type=float, default=64.0)
    g.add_argument("--capacity-iters", type=int, default=4, help="bisection steps after the doubling")
    args = parser.parse_args(argv)
    exit_on_sigterm()
    fit_to_model(args)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.capacity and args.slo_itl_ms is None and args.slo_ttft_ms is None:
        parser.error("--capacity needs --slo-itl-ms and/or --slo-ttft-ms")
    vocab = args.vocab_size or vocab_size_of(args.model_dir) or DEFAULT_VOCAB_SIZE
    ttft_group = "long" if args.workload == "interference" else "all"
    itl_group = "steady" if args.workload == "interference" else "all"

    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    for t in targets:
        try:
            if t != "auto":
                float(t)
        except ValueError:
            parser.error(f"--targets: {t!r} is neither milliseconds nor auto")
    runs: list[tuple[int | None, str | None, bool]] = [(b, None, False) for b in parse_budgets(args.budgets)]
    runs += [(None, t, False) for t in targets]
    runs += [(None, None, True)] if args.default else []
    points = [measure_budget(args, budget, vocab, target, default)
              for budget, target, default in runs[:: -1 if args.reverse else 1]]

    table = summary_table(points, ttft_group, itl_group)
    if args.targets or args.default:
        table += "\n" + "\n".join(verdict_lines(verdict_results(points, ttft_group, itl_group)))
    print("\n" + table)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "sweep.txt").write_text(table + "\n")
    write_json(args.out_dir / "sweep.json", {"config": args_config(args), "points": points})
    curves = [c for c in (curve_point(p, ttft_group, itl_group) for p in points) if c is not None]
    if curves:
        title = f"{args.engine}, {args.model_dir.name}, {args.workload} workload"
        plot_budget_curves(curves, title, ttft_group, itl_group, args.out_dir / "sweep.png")
        print(f"wrote {args.out_dir / 'sweep.png'}, sweep.json, sweep.txt")
    return 0 if all(p.stats is not None for p in points) else 1


if __name__ == "__main__":
    sys.exit(main())
