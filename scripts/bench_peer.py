#!/usr/bin/env python3
"""evenflow against its peers on one model: same budget, max_model_len, KV size (tokens) and seeded
workloads, one server after the other in one run, printed side by side with ratios and start-up times.

``--engines`` picks them (evenflow/engines.py): by default evenflow and vLLM's CPU build on the HF
folder ``--model-dir``; evenflow-f32/-bf16/-int4 and llama.cpp's llama-server serve the GGUF file
``--gguf`` (the HF folder is made from it: ``python -m evenflow.bench.hf_folder``). vLLM runs from its
own venv (``--peer-venv``) through a CLI shim (``--peer-shim``); docs/peer.md says how to install
both peers. An engine that cannot run here is said so and left out. Servers never run at the same
time: the cores belong to the one under test. ``--rounds N`` measures every engine N times, the
order reversed every other round.

    python scripts/bench_peer.py --model-dir /tmp/small --budgets 256 \\
        --workloads interference,poisson --duration 40 --rate 2 --out-dir bench_results/peer

    python scripts/bench_peer.py --model-dir /work/peers/smollm2-hf --gguf SmolLM2.Q4_1.gguf \\
        --engines evenflow-f32,evenflow-int4,evenflow-bf16,vllm,llama.cpp --vllm-dtype bfloat16 \\
        --budgets 256 --workloads interference --duration 120 --rounds 3 --out-dir bench_results/peer
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path


from evenflow.bench.engines import add_engine_args, engine_problem, engine_spec, parse_engines
from evenflow.bench.launch import add_server_args, fit_to_model, parse_budgets, server_config
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
    startup_s: float | None = None  # launch to the first healthy /health of this engine's server


# (label, how to read it from a group, True when higher is better); "start-up s" is the server's.
ROWS: list[tuple[str, str, bool]] = [
    ("total tok/s", "total_throughput", True),
    ("output tok/s", "output_throughput", True),
    ("TTFT p50 ms", "ttft.p50", False),
    ("TTFT p99 ms", "ttft.p99", False),
    ("long TTFT p50 ms", "long:ttft.p50", False),
    ("TPOT p50 ms", "tpot.p50", False),
    ("ITL p50 ms", "itl.p50", False),
    ("ITL p99 ms", "itl.p99", False),
    ("ITL p99.9 ms", "itl.p999", False),
    ("ITL max ms", "itl.max", False),
    ("start-up s", "startup", False),
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
        spec = engine_spec(args, engine, cfg)
        print(f"\n=== {engine} budget {cfg.label}: {' '.join(spec.argv)}", flush=True)
        try:
            with ManagedServer(spec) as server:
                print(f"{engine} ready after {server.ready_s:.1f} s", flush=True)
                for name in workloads:
                    wl_args = argparse.Namespace(**vars(args))
                    wl_args.workload = name
                    result = run_benchmark(workload_from_args(wl_args, vocab), options_from_args(args, spec.base_url))
                    print(f"--- {engine} / {cfg.label} / {name}")
                    print(format_table(result.stats))
                    print(format_engine(result))
                    if not args.save_requests:
                        result.records = []  # large; kept only when asked
                    out.append(Measurement(engine, cfg.label, name, result, round=round_, startup_s=server.ready_s))
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


def comparison_table(ms: list[Measurement], engines: list[str]) -> str:
    """Per budget and workload: each engine's column, then each engine's ratio to the first.

    With several rounds a column is the median over its rounds, a ratio is of those medians, and
    the ratio of every round follows in brackets (a run's noise shows in their spread)."""
    lines: list[str] = []
    rounds = sorted({m.round for m in ms})
    keys = sorted({(m.budget, m.workload) for m in ms})
    base = engines[0]
    width = max(12, *(len(e) + 2 for e in engines))
    for budget, workload in keys:
        def pick(engine: str, r: int | None = None) -> list[Measurement]:
            return [m for m in ms if m.engine == engine and (m.budget, m.workload) == (budget, workload)
                    and (r is None or m.round == r)]

        what = f" (median of {len(rounds)} rounds)" if len(rounds) > 1 else ""
        lines.append(f"\nbudget {budget}, workload {workload}{what}")
        lines.append(f"{'':18}" + "".join(f"{e:>{width}}" for e in engines))
        for label, path, _ in ROWS:
            lines.append(f"{label:18}" + "".join(f"{_fmt(_median(pick(e), path)):>{width}}" for e in engines))
        if len(engines) < 2:
            continue
        each = " (each round)" if len(rounds) > 1 else ""
        lines.append(f"ratio to {base}{each}")
        for label, path, higher_better in ROWS:
            cells = []
            for e in engines[1:]:
                cell = _ratio(_median(pick(e), path), _median(pick(base), path))
                if len(rounds) > 1:
                    cell += " [" + " ".join(_ratio(_median(pick(e, r), path), _median(pick(base, r), path))
                                            for r in rounds) + "]"
                cells.append(f"{e}: {cell}")
            lines.append(f"  {label:18}" + "   ".join(cells))
    return "\n".join(lines)


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a is not None and b else "-"


def _median(ms: list[Measurement], path: str) -> float | None:
    values = [v for m in ms if (v := _value(m, path)) is not None]
    return statistics.median(values) if values else None


def _value(m: Measurement | None, path: str) -> float | None:
    if m is None or m.result is None or not m.result.stats.groups:
        return None
    if path == "startup":
        return m.startup_s
    groups = m.result.stats.groups
    if ":" in path:
        kind, path = path.split(":", 1)
        group = groups.get(kind)
    else:
        group = groups["all"] if path.endswith("throughput") else focus_group(m.result)[1]
    # A group none of whose requests completed has no latencies (its zeros are not measurements).
    if group is None or (not path.endswith("throughput") and group.completed == 0):
        return None
    return read(group, path)


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_args(parser)
    add_engine_args(parser)
    add_run_args(parser, standalone=False)
    add_workload_args(parser)
    g = parser.add_argument_group("comparison")
    g.add_argument("--budgets", default="256", help="comma list; 'unchunked' allowed")
    g.add_argument("--workloads", default="interference", help="comma list of interference,poisson")
    g.add_argument("--rounds", type=int, default=1,
                   help="measure every engine this many times, the order reversed every other round; the "
                        "table shows medians and each round's ratio (this machine's noise is as large as the gaps)")
    g.add_argument("--out-dir", type=Path, default=Path("bench_results/peer"))
    args = parser.parse_args(argv)
    exit_on_sigterm()
    fit_to_model(args)
    vocab = args.vocab_size or vocab_size_of(args.model_dir) or DEFAULT_VOCAB_SIZE
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]

    engines, problems = [], {}
    for engine in parse_engines(args):
        problem = engine_problem(args, engine)
        if engine == "vllm" and not args.peer_cmd:
            problem = peer_problem(args.peer_venv, args.peer_shim)
        if problem:
            problems[engine] = problem
            print(f"peer {engine} cannot run here: {problem}; measuring without it", flush=True)
        else:
            engines.append(engine)
    if not engines:
        print("no engine can run here", flush=True)
        return 1
    measurements: list[Measurement] = []
    for round_ in range(max(args.rounds, 1)):
        # Reverse the order every other round, so a drift in the machine's speed favours no engine.
        for engine in engines if round_ % 2 == 0 else engines[::-1]:
            measurements += measure_engine(args, engine, workloads, vocab, round_)

    table = comparison_table(measurements, engines)
    print("\n(throughput over all requests; latencies of the steady streams in interference)" + table)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "peer.txt").write_text(table + "\n")
    write_json(args.out_dir / "peer.json", {"config": args_config(args), "peer_problems": problems,
                                            "measurements": measurements})
    print(f"wrote {args.out_dir / 'peer.txt'} and peer.json")
    return 0 if all(m.result is not None for m in measurements) else 1


if __name__ == "__main__":
    sys.exit(main())
