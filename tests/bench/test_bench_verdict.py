"""The adaptive budget's bar as evenflow/bench/verdict.py applies it (no server)."""

from __future__ import annotations

import json
from pathlib import Path

from evenflow.bench.verdict import Result, results_from_json, run_result, verdict_lines


def fixed(label: str, ttft: float, p99: float, p999: float, tok_s: float) -> Result:
    return Result(label, None, ttft, p99, p999, tok_s)


def test_the_best_fixed_budget_is_the_fastest_to_first_token_among_those_meeting_the_target() -> None:
    results = [
        fixed("64", 400, 14.5, 20.2, 2300),
        fixed("48", 600, 16.3, 22.7, 2160),  # within 15% of 15 ms
        fixed("256", 260, 19.9, 38.4, 2400),  # p99 over 1.15x
        fixed("unchunked", 200, 11.3, 181, 2260),  # p99 fine, but a 181 ms stall every prompt
        Result("target 15 ms", 15.0, 780, 16.3, 29.0, 2150),
    ]
    (line,) = verdict_lines(results)
    assert line.startswith("target 15 ms: held (p99 16.3, 1.09x the target")
    assert "does not beat the best fixed budget meeting it, 64 (of 64, 48)" in line
    assert "TTFT p50 1.95x, throughput 0.93x" in line


def test_a_run_that_matches_or_betters_both_measures_beats_it_and_none_meeting_says_so() -> None:
    results = [fixed("64", 400, 14.0, 20.0, 2000), Result("target 15 ms", 15.0, 400, 15.0, 20.0, 2000),
               Result("target 5 ms", 5.0, 900, 9.0, 12.0, 1500)]
    beat, none = verdict_lines(results)
    assert "beats the best fixed budget meeting it, 64" in beat and "does not" not in beat
    assert none == "target 5 ms: missed (p99 9.0, 1.80x the target; p99.9 12.0); no fixed budget meets it"


def test_a_derived_target_is_judged_by_its_run_median_whatever_the_run_is_called() -> None:
    def target_of(label: str, derived_ms: float | None) -> float | None:
        return run_result(label, derived_ms, 0.0, 0.0, 0.0, 0.0).target_ms

    assert target_of("target auto", 68.7) == 68.7
    assert target_of("default", 68.7) == 68.7
    assert target_of("default", 0.0) is None  # the fixed default: a budget, not a target
    assert target_of("target 15 ms", None) == 15.0
    assert target_of("2048", None) is None
    results = [fixed("128", 300, 60.0, 90.0, 2000), fixed("default", 250, 20.0, 380.0, 2100),
               run_result("target auto", 68.7, 400, 65.3, 84.1, 2050)]
    (line,) = verdict_lines(results)
    assert line.startswith("target auto (target 68.7 ms): held (p99 65.3, 0.95x the target")
    assert "best fixed budget meeting it, 128 (of 128)" in line  # the default's 380 ms stall is over 2x
    unknown = run_result("target auto", None, 200, 10.0, 12.0, 3000)
    (line,) = verdict_lines(results + [unknown])  # not judged, and no fixed budget either
    assert "(of 128)" in line


def test_sweep_json_runs_carry_their_derived_targets(tmp_path: Path) -> None:
    def point(label: str, target_ms: float | None, p99: float) -> dict[str, object]:
        stats = {"ttft": {"p50": 300.0}, "itl": {"p99": p99, "p999": p99 * 1.2}}
        groups = {"long": stats, "steady": stats, "all": {"total_throughput": 2000.0}}
        return {"label": label, "stats": {"groups": groups}, "engine": {"target_itl_ms": target_ms}}

    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"config": {"workload": "interference"},
                                "points": [point("128", None, 60.0), point("target auto", 70.0, 66.0)]}))
    fixed_run, auto = results_from_json(str(path))
    assert fixed_run.target_ms is None and auto.target_ms == 70.0
