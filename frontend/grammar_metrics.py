"""The structured output compile histogram, from the engine's SchedulerStats.

``evenflow:grammar_compile_seconds``: one observation per grammar compiled, bounds in
``protocol/structured_outputs.py``; the engine counts compiles per bucket (its cache hits are the
``evenflow:grammar_cache_hits_total`` counter in metrics.py's ENGINE_METRICS).
"""

from __future__ import annotations

import itertools

from prometheus_client.core import HistogramMetricFamily

from evenflow.protocol import SchedulerStats
from evenflow.protocol.structured_outputs import COMPILE_BUCKETS_S


def grammar_compile_histogram(stats: SchedulerStats, labels: list[str], values: list[str]) -> HistogramMetricFamily:
    counts = stats.grammar_compile_buckets or [0] * (len(COMPILE_BUCKETS_S) + 1)
    bounds = [*(repr(float(b)) for b in COMPILE_BUCKETS_S), "+Inf"]
    histogram = HistogramMetricFamily("evenflow:grammar_compile_seconds",
                                      "Seconds to compile a structured output grammar (off the engine loop).",
                                      labels=labels)
    histogram.add_metric(values, list(zip(bounds, itertools.accumulate(counts))), stats.grammar_compile_s)
    return histogram
