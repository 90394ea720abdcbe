"""The adaptive budget's bar: at each target, against the best fixed budget that also meets it.

A run *meets* a target T when its ITL p99 is within 15% of T (the bar ``--target-itl-ms`` is held
to) and its ITL p99.9 is at most 2T. The second rule is ours: p99 alone does not see a stall that
hits fewer than 1% of the gaps, so on a workload where long prompts are rare an unchunked server
"meets" any p99 target while every stream stops for a whole prompt's prefill (tiny model: p99 11 ms,
p99.9 190 ms). Among the fixed budgets that meet T, the best is the one with the lowest TTFT p50
(then the highest throughput); the adaptive run is compared with it.

    python -m evenflow.bench.verdict RUN_DIR/sweep.json [...]   # a verdict per target per file
``sweep_budget.py --targets`` prints the same lines after its table.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

P99_SLACK = 1.15
P999_FACTOR = 2.0


@dataclass(frozen=True)
class Result:
    label: str
    target_ms: float | None  # None: a fixed budget
    ttft_p50: float
    itl_p99: float
    itl_p999: float
    tok_s: float
    derived: bool = False  # the target is the engine's own (``target auto``, or a default that derives one)

    def meets(self, target_ms: float) -> bool:
        return self.itl_p99 <= P99_SLACK * target_ms and self.itl_p999 <= P999_FACTOR * target_ms


def verdict_lines(results: list[Result]) -> list[str]:
    lines = []
    for run in (r for r in results if r.target_ms is not None):
        t = run.target_ms
        assert t is not None
        # A derived target not known (no samples) is no fixed budget either.
        fixed = (r for r in results if r.target_ms is None and not r.derived)
        meeting = sorted((r for r in fixed if r.meets(t)), key=lambda r: (r.ttft_p50, -r.tok_s))
        held = "held" if run.meets(t) else "missed"
        name = f"{run.label} (target {t:.1f} ms)" if run.derived else run.label
        head = (f"{name}: {held} (p99 {run.itl_p99:.1f}, {run.itl_p99 / t:.2f}x the target; "
                f"p99.9 {run.itl_p999:.1f})")
        if not meeting:
            lines.append(f"{head}; no fixed budget meets it")
            continue
        best = meeting[0]
        ttft, tput = run.ttft_p50 / best.ttft_p50, run.tok_s / best.tok_s
        won = "beats" if ttft <= 1.0 and tput >= 1.0 else "does not beat"
        lines.append(f"{head}; {won} the best fixed budget meeting it, {best.label} "
                     f"(of {', '.join(r.label for r in meeting)}): TTFT p50 {ttft:.2f}x, throughput {tput:.2f}x")
    return lines


def run_result(label: str, derived_ms: float | None, ttft_p50: float, itl_p99: float, itl_p999: float,
               tok_s: float) -> Result:
    """A sweep's run as the bar judges it, by its label: a fixed budget (``256``, ``default``), a target it
    names (``target 15 ms``), or a target the engine derived (``target auto``, or ``default`` where the
    default derives one), judged by ``derived_ms``, the median of the run's samples of it."""
    derived = label == "target auto" or (label == "default" and bool(derived_ms))
    if derived:
        target = derived_ms or None
    else:
        target = float(label.split()[1]) if label.startswith("target") else None
    return Result(label, target, ttft_p50, itl_p99, itl_p999, tok_s, derived=derived)


def results_from_json(path: str) -> list[Result]:
    """The runs of one ``sweep.json`` (TTFT of the long prompts and ITL of the streams in
    ``interference``, of all requests in ``poisson``)."""
    data = json.load(open(path))
    interference = data["config"].get("workload") == "interference"
    out = []
    for p in data["points"]:
        if p.get("stats") is None:
            continue
        groups = p["stats"]["groups"]
        t = groups["long" if interference else "all"]["ttft"]
        i = groups["steady" if interference else "all"]["itl"]
        out.append(run_result(p["label"], (p.get("engine") or {}).get("target_itl_ms"), t["p50"], i["p99"], i["p999"],
                              groups["all"]["total_throughput"]))
    return out


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(arg)
        for line in verdict_lines(results_from_json(arg)):
            print("  " + line)
