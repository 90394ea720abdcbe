"""Prometheus text for the adaptive token budget (``--target-itl-ms``), from the engine's stats.

Kept apart from ``metrics.py`` so the two change independently: ``render_budget_metrics`` returns
finished exposition lines, all zero when the engine runs a fixed budget.
"""

from __future__ import annotations

from evenflow.protocol import SchedulerStats


def render_budget_metrics(e: SchedulerStats, label: str) -> list[str]:
    """Gauges, counters and the chosen-budget histogram (buckets: powers of two, as the engine counts)."""
    out: list[str] = []

    def metric(name: str, kind: str, help_text: str, value: float) -> None:
        out.append(f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n{name}{{{label}}} {value!r}")

    metric("evenflow:target_itl_seconds", "gauge", "Step-time target of the adaptive budget (0: fixed budget).",
           float(e.target_itl_s))
    metric("evenflow:token_budget", "gauge", "Token budget the adaptive budget chose for the last step.",
           float(e.token_budget))
    name = "evenflow:token_budget_tokens"
    out.append(f"# HELP {name} Token budgets chosen per step by the adaptive budget.\n# TYPE {name} histogram")
    cumulative = 0
    for i, count in enumerate(e.token_budget_log2_counts):
        cumulative += count
        out.append(f'{name}_bucket{{{label},le="{2 ** i}"}} {cumulative}')
    out.append(f'{name}_bucket{{{label},le="+Inf"}} {cumulative}')
    out.append(f"{name}_sum{{{label}}} {e.token_budget_sum}")
    out.append(f"{name}_count{{{label}}} {cumulative}")
    metric("evenflow:step_time_predicted_seconds_total", "counter",
           "Predicted time of the steps that carried decodes, summed.", float(e.step_predicted_s))
    metric("evenflow:step_time_measured_seconds_total", "counter",
           "Measured (worker) time of the same steps, summed.", float(e.step_measured_s))
    metric("evenflow:target_steps_total", "counter", "Steps with decodes that the adaptive budget planned.",
           float(e.num_controlled_steps))
    metric("evenflow:target_steps_within_total", "counter", "Of those, steps whose measured time met the target.",
           float(e.num_steps_within_target))
    share = e.num_steps_within_target / e.num_controlled_steps if e.num_controlled_steps else 0.0
    metric("evenflow:target_steps_within_ratio", "gauge", "Share of planned steps whose time met the target.", share)
    return out
