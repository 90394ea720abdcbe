#!/usr/bin/env python3
"""The interference workload on a virtual clock: each budget's hand-out, with steps priced by the model's
measured CPU cost (evenflow/bench/virtual_interference.py says what is and is not modelled).

    python scripts/bench_virtual_interference.py --model-dir /tmp/tiny [--budgets 32,64,128,256,2048]
        [--targets 100] [--streams 6] [--long-interval 10] [--duration 84] [--seeds 0,1]

Rows: the default (no flag: the fixed 2048-token budget), the derived target (``--target-itl-ms auto``,
under the default 2048 ceiling), each fixed budget, each ``--target-itl-ms``; columns as the issue's table:
the streams' ITL p50/p99/max and gaps over 250 ms, the long prompts' TTFT p50, output tokens/s, and the
scheduler's own time a step (schedule and update, the budget controller's work included). ``--seeds`` runs
each configuration once per jitter seed and prints the median of each column.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from evenflow.bench.plot import CurvePoint, plot_budget_curves
from evenflow.bench.virtual_interference import MachineCosts, Workload, measure_costs, run
from evenflow.core.sched import auto_target
from evenflow.core.sched.config import SchedulerConfig
from evenflow.core.sched.step_time_model import shape_of_step

COLUMNS = ("itl_p50", "itl_p99", "itl_max", "gaps_over_250", "ttft_p50", "ttft_p99", "out_tok_s")


def configs(args: argparse.Namespace) -> list[tuple[str, dict[str, object], float | None]]:
    """(label, SchedulerConfig options, the derived target's decode-step multiple for this run)."""
    runs: list[tuple[str, dict[str, object], float | None]] = [("default", {}, None),
                                                               ("target auto", dict(auto_target_itl=True), None)]
    runs += [(f"auto, {k}x decode", dict(auto_target_itl=True), float(k)) for k in args.auto_multiples.split(",") if k]
    runs += [(f"fixed {b}", dict(max_num_batched_tokens=int(b)), None) for b in args.budgets.split(",") if b]
    runs += [(f"target {t} ms", dict(target_itl_ms=float(t)), None) for t in args.targets.split(",") if t]
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--budgets", default="32,64,128,256,2048")
    ap.add_argument("--targets", default="")
    ap.add_argument("--streams", type=int, default=6)
    ap.add_argument("--long-prompt-len", type=int, default=2048)
    ap.add_argument("--long-interval", type=float, default=0.0, help="seconds (0: 4x the unchunked prefill)")
    ap.add_argument("--duration", type=float, default=0.0, help="seconds (0: 8 long prompts)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--auto-multiples", default="",
                    help="also run the derived target with these decode-step multiples (the study behind the default's)")
    ap.add_argument("--plot", type=Path, default=None, help="the four curves, the default marked, to this PNG")
    ap.add_argument("--costs", default="", help="5 comma-separated costs instead of measuring them")
    args = ap.parse_args()
    costs = (MachineCosts(tuple(float(c) for c in args.costs.split(","))) if args.costs  # type: ignore[arg-type]
             else measure_costs(args.model_dir, args.dtype))
    unchunked = costs.seconds(shape_of_step(0, 0, [(args.long_prompt_len, 0)]))
    decode = costs.seconds(shape_of_step(args.streams, args.streams * 160, []))
    interval = args.long_interval or 4 * unchunked
    load = Workload(streams=args.streams, long_prompt_len=args.long_prompt_len, long_interval_s=interval,
                    duration_s=args.duration or 8 * interval)
    print(f"costs (fixed, token, read, pair, request): {', '.join(f'{c:.3g}' for c in costs.coefficients)}")
    print(f"unchunked {args.long_prompt_len}-token prefill {unchunked:.2f} s, decode step of {args.streams} "
          f"{decode * 1e3:.1f} ms; a long prompt every {interval:.1f} s for {load.duration_s:.0f} s")
    print("| run | target ms | mean budget | ITL p50 | ITL p99 | ITL max | gaps > 250 ms | long TTFT p50 s | out tok/s "
          "| scheduler us/step |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    seeds = [int(s) for s in args.seeds.split(",")]
    default_multiple = auto_target.AUTO_TARGET_DECODE_MULTIPLE
    points: list[CurvePoint] = []
    for label, options, multiple in configs(args):
        config = SchedulerConfig(num_kv_blocks=4096, max_model_len=4096, max_num_seqs=64, **options)  # type: ignore[arg-type]
        auto_target.AUTO_TARGET_DECODE_MULTIPLE = default_multiple if multiple is None else multiple
        results = [run(label, config, costs, load, seed) for seed in seeds]
        med = {c: statistics.median(r.summary()[c] for r in results) for c in COLUMNS}
        target = statistics.median(r.target_ms for r in results)
        budget = statistics.median(r.mean_budget for r in results)
        engine_us = statistics.median(r.engine_us_per_step for r in results)
        print(f"| {label} | {target:.0f} | {budget:.0f} | {med['itl_p50']:.0f} | {med['itl_p99']:.0f} | "
              f"{med['itl_max']:.0f} | {med['gaps_over_250']:.0f} | {med['ttft_p50']:.2f} | {med['out_tok_s']:.1f} | "
              f"{engine_us:.0f} |",
              flush=True)
        if not label.startswith("auto,"):
            per_step = statistics.median(r.tokens_per_step for r in results)
            points.append(CurvePoint(label.removeprefix("fixed "), label.startswith("target"), 1e3 * med["ttft_p50"],
                                     1e3 * med["ttft_p99"], med["itl_p99"], med["itl_max"], med["out_tok_s"],
                                     med["out_tok_s"], per_step, None, default=label == "default"))
    if args.plot is not None:
        plot_budget_curves(points, f"virtual clock, {Path(args.model_dir).name}, interference", "long", "steady",
                           args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
