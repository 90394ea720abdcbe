"""The adaptive budget's histogram of chosen token budgets (``--target-itl-ms``), from the engine's stats.

The engine counts its choices in power-of-two buckets (bucket i: budgets in (2**(i-1), 2**i]) so
that every frontend renders the same bounds; empty with a fixed budget. Its gauges and counters
are plain ``EngineMetric`` lines in ``metrics.py``.
"""

from __future__ import annotations

import itertools

from prometheus_client.core import HistogramMetricFamily

from evenflow.protocol import SchedulerStats


def token_budget_histogram(e: SchedulerStats, labels: list[str], values: list[str]) -> HistogramMetricFamily:
    histogram = HistogramMetricFamily("evenflow:token_budget_tokens",
                                      "Token budgets chosen per step by the adaptive budget.", labels=labels)
    cumulative = list(itertools.accumulate(e.token_budget_log2_counts))
    bounds = [str(2**i) for i in range(len(cumulative))]
    total = cumulative[-1] if cumulative else 0
    histogram.add_metric(values, [*zip(bounds, cumulative), ("+Inf", total)], e.token_budget_sum)
    return histogram
