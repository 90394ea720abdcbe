"""The adaptive budget's bar as scripts/_bench_verdict.py applies it (no server)."""

from __future__ import annotations

from evenflow.bench.verdict import Result, verdict_lines


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
