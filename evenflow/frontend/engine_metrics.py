"""What ``/metrics`` and the periodic log line read from the engine's ``SchedulerStats``.

Adding an engine metric is one line in ``ENGINE_METRICS`` (after adding the field to its owner's
part of ``SchedulerStats``, evenflow/protocol/stats.py). The frontend's own counters and histograms,
snapshots and merging are in evenflow/frontend/metrics.py.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import NamedTuple

from prometheus_client.core import HistogramMetricFamily

from evenflow.protocol import SchedulerStats
from evenflow.protocol.structured_outputs import COMPILE_BUCKETS_S


class EngineMetric(NamedTuple):
    """A metric read from the engine's ``SchedulerStats``."""

    name: str
    kind: str  # "gauge" or "counter"
    help: str
    value: Callable[[SchedulerStats], float]


ENGINE_METRICS: list[EngineMetric] = [
    EngineMetric("evenflow:num_requests_running", "gauge", "Requests in the engine's running batch.",
                 lambda e: e.scheduler.num_running),
    EngineMetric("evenflow:num_requests_waiting", "gauge", "Requests waiting to be scheduled.",
                 lambda e: e.scheduler.num_waiting),
    EngineMetric("evenflow:kv_cache_usage_perc", "gauge", "KV cache usage (1 = full).", lambda e: e.kv_cache.usage),
    EngineMetric("evenflow:num_preemptions_total", "counter", "Preemptions by the scheduler.",
                 lambda e: e.scheduler.num_preemptions),
    EngineMetric("evenflow:layered_prefills_total", "counter",
                 "Prompt chunks prefilled by layer groups beside decodes (the adaptive budget's).",
                 lambda e: e.scheduler.num_layered_prefills),
    EngineMetric("evenflow:layer_group_steps_total", "counter", "Steps that carried a layer group of a prompt.",
                 lambda e: e.scheduler.num_layer_group_steps),
    EngineMetric("evenflow:layered_prefills_stopped_total", "counter",
                 "Prompts that stopped climbing the layers and went on in token chunks (a layer overran the room).",
                 lambda e: e.scheduler.num_layered_prefills_stopped),
    EngineMetric("evenflow:prefix_cache_queries_total", "counter",
                 "Prefix cache queries, in tokens (each request's prompt once, not again after a preemption).",
                 lambda e: e.kv_cache.prefix_cache_queries),
    EngineMetric("evenflow:prefix_cache_hits_total", "counter", "Prefix cache hits, in tokens (of those queries).",
                 lambda e: e.kv_cache.prefix_cache_hits),
    EngineMetric("evenflow:num_steps_total", "counter", "Engine steps that ran the model.",
                 lambda e: e.scheduler.num_steps),
    EngineMetric("evenflow:scheduled_tokens_total", "counter",
                 "Tokens computed by the model: the sum of every step's scheduled tokens (recomputation after "
                 "preemption included; a prompt's layer group counts its share of its tokens).",
                 lambda e: e.scheduler.num_scheduled_tokens),
    EngineMetric("evenflow:worker_forward_seconds_total", "counter", "Seconds the workers spent in forward passes.",
                 lambda e: e.workers.forward_s),
    EngineMetric("evenflow:worker_idle_seconds_total", "counter",
                 "Seconds the workers waited on the engine-core while it had work.", lambda e: e.workers.idle_s),
    EngineMetric("evenflow:worker_contended_steps_total", "counter",
                 "Steps rank 0 ran on every core while another process held one (the adaptive budget learns "
                 "nothing from their times).", lambda e: e.workers.num_contended_steps),
    # The adaptive budget (--target-itl-ms; all 0 with a fixed budget). Its histogram: token_budget_histogram.
    EngineMetric("evenflow:target_itl_seconds", "gauge", "Step-time target of the adaptive budget (0: fixed budget).",
                 lambda e: e.budget.target_itl_s),
    EngineMetric("evenflow:token_budget", "gauge", "Token budget the adaptive budget chose for the last step.",
                 lambda e: e.budget.token_budget),
    EngineMetric("evenflow:step_time_predicted_seconds_total", "counter",
                 "Predicted time of the steps with decodes that the adaptive budget planned.",
                 lambda e: e.budget.step_predicted_s),
    EngineMetric("evenflow:step_time_measured_seconds_total", "counter", "Measured time of the same steps.",
                 lambda e: e.budget.step_measured_s),
    EngineMetric("evenflow:target_steps_total", "counter", "Steps with decodes that the adaptive budget planned.",
                 lambda e: e.budget.num_controlled_steps),
    EngineMetric("evenflow:target_steps_within_total", "counter", "Of those, steps whose measured time met the target.",
                 lambda e: e.budget.num_steps_within_target),
    EngineMetric("evenflow:target_steps_within_ratio", "gauge", "Share of planned steps whose time met the target.",
                 lambda e: (e.budget.num_steps_within_target / e.budget.num_controlled_steps
                            if e.budget.num_controlled_steps else 0.0)),
    EngineMetric("evenflow:grammar_cache_hits_total", "counter",
                 "Structured output requests whose grammar was already compiled or compiling.",
                 lambda e: e.grammar.cache_hits),
    # Speculative decoding (vLLM's names); a draft = one request's drafts verified in one step.
    EngineMetric("evenflow:spec_decode_num_drafts_total", "counter", "Speculative drafts verified.",
                 lambda e: e.spec_decode.num_drafts),
    EngineMetric("evenflow:spec_decode_num_draft_tokens_total", "counter", "Draft tokens verified.",
                 lambda e: e.spec_decode.num_draft_tokens),
    EngineMetric("evenflow:spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.",
                 lambda e: e.spec_decode.num_accepted_tokens),
]


def stats_log_line(prev: SchedulerStats | None, cur: SchedulerStats, seconds: float) -> str | None:
    """vLLM-style throughput line since ``prev``; None when there was no activity to report."""
    p, c = (prev or SchedulerStats()).scheduler, cur.scheduler
    prompt = c.num_prompt_tokens - p.num_prompt_tokens
    gen = c.num_generation_tokens - p.num_generation_tokens
    if prompt == 0 and gen == 0 and c.num_running == 0 and c.num_waiting == 0:
        return None
    dt = max(seconds, 1e-9)
    kv, pkv = cur.kv_cache, (prev or SchedulerStats()).kv_cache
    hit = (kv.prefix_cache_hits - pkv.prefix_cache_hits) / max(1, kv.prefix_cache_queries - pkv.prefix_cache_queries)
    return (
        f"Avg prompt throughput: {prompt / dt:.1f} tokens/s, Avg generation throughput: {gen / dt:.1f} tokens/s, "
        f"Running: {c.num_running} reqs, Waiting: {c.num_waiting} reqs, "
        f"KV cache usage: {kv.usage * 100:.1f}%, Prefix cache hit rate: {hit * 100:.1f}%"
    )


def token_budget_histogram(e: SchedulerStats, labels: list[str], values: list[str]) -> HistogramMetricFamily:
    """The adaptive budget's chosen budgets, counted by the engine in power-of-two buckets (bucket i:
    (2**(i-1), 2**i]) so every frontend renders the same bounds; empty with a fixed budget."""
    histogram = HistogramMetricFamily("evenflow:token_budget_tokens",
                                      "Token budgets chosen per step by the adaptive budget.", labels=labels)
    cumulative = list(itertools.accumulate(e.budget.token_budget_log2_counts))
    bounds = [str(2**i) for i in range(len(cumulative))]
    total = cumulative[-1] if cumulative else 0
    histogram.add_metric(values, [*zip(bounds, cumulative), ("+Inf", total)], e.budget.token_budget_sum)
    return histogram


def grammar_compile_histogram(stats: SchedulerStats, labels: list[str], values: list[str]) -> HistogramMetricFamily:
    """``evenflow:grammar_compile_seconds``: one observation per grammar compiled, bounds from protocol."""
    counts = stats.grammar.compile_buckets or [0] * (len(COMPILE_BUCKETS_S) + 1)
    bounds = [*(repr(float(b)) for b in COMPILE_BUCKETS_S), "+Inf"]
    histogram = HistogramMetricFamily("evenflow:grammar_compile_seconds",
                                      "Seconds to compile a structured output grammar (off the engine loop).",
                                      labels=labels)
    histogram.add_metric(values, list(zip(bounds, itertools.accumulate(counts))), stats.grammar.compile_s)
    return histogram
