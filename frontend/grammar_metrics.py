"""Structured output metrics, from the engine's SchedulerStats, in the Prometheus text format.

``evenflow:grammar_compile_seconds`` (histogram: one observation per grammar compiled, bounds in
``protocol/structured_outputs.py``) and ``evenflow:grammar_cache_hits_total`` (requests whose
grammar was already compiled or compiling). Kept apart from metrics.py so it renders the same
whatever that module's layout.
"""

from __future__ import annotations

from evenflow.protocol import SchedulerStats
from evenflow.protocol.structured_outputs import COMPILE_BUCKETS_S


def render_grammar_metrics(stats: SchedulerStats, label: str, fmt) -> list[str]:  # noqa: ANN001
    """Prometheus lines; ``label`` is the rendered label set, ``fmt`` formats a number."""
    name = "evenflow:grammar_compile_seconds"
    lines = [f"# HELP {name} Seconds to compile a structured output grammar (off the engine loop).",
             f"# TYPE {name} histogram"]
    counts = stats.grammar_compile_buckets or [0] * (len(COMPILE_BUCKETS_S) + 1)
    cumulative = 0
    for bound, count in zip([*COMPILE_BUCKETS_S, float("inf")], counts):
        cumulative += count
        lines.append(f'{name}_bucket{{{label},le="{fmt(bound)}"}} {cumulative}')
    lines += [f"{name}_sum{{{label}}} {fmt(stats.grammar_compile_s)}", f"{name}_count{{{label}}} {cumulative}"]
    hits = "evenflow:grammar_cache_hits_total"
    lines += [f"# HELP {hits} Structured output requests whose grammar was already compiled or compiling.",
              f"# TYPE {hits} counter", f"{hits}{{{label}}} {stats.grammar_cache_hits}"]
    return lines
