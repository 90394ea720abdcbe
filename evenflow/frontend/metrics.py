"""Prometheus metrics for one or many frontends.

Two kinds of numbers:

* engine-wide (running/waiting requests, KV usage, preemptions, prefix cache, steps): taken from the
  engine's latest ``SchedulerStats``. Every frontend sees the same engine, so merging takes the
  freshest snapshot instead of a sum. With several engine-cores (data parallel) each also appears
  with an ``engine="i"`` label (its position in ``--engine``), and the unlabelled series is the
  total (KV cache usage: the mean).
* request-level (token counters, finished requests by reason, latency histograms): counted by the
  frontend that served the request. With N frontends behind one port a scrape lands on one of
  them, so each frontend publishes its snapshot as a file in ``EVENFLOW_METRICS_DIR`` (atomically,
  about every second and at scrape time) and ``/metrics`` sums all the files: each request is
  counted once, by the frontend that served it.

prometheus_client writes the exposition format. Its multiprocess mode is not used: it sums every
process's value of a counter, but the engine-wide counters are one engine's, seen by N frontends
(summing would count them N times), and it keys files by PID from an environment variable read at
import, so two FrontendMetrics in one process (tests, the offline ``LLM``) would share them.

Adding a metric is one line: an ``EngineMetric`` in ``ENGINE_METRICS`` (evenflow/frontend/engine_metrics.py:
a value the engine reports in ``SchedulerStats``), or a name in ``COUNTERS`` / ``HISTOGRAMS`` (counted here,
then ``metrics.counters[name] += n`` / ``metrics.histograms[name].observe(x)`` where it happens).
"""

from __future__ import annotations

import bisect
import itertools
import os
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
from msgspec import Struct
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from evenflow.frontend.engine_metrics import ENGINE_METRICS, grammar_compile_histogram, token_budget_histogram
from evenflow.protocol import SchedulerStats


# Bucket bounds as vLLM uses them, so dashboards built for vLLM read these histograms the same way.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0]
ITL_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]

HISTOGRAMS: dict[str, tuple[list[float], str]] = {
    "evenflow:time_to_first_token_seconds": (TTFT_BUCKETS, "Time from arrival to the first output token."),
    "evenflow:inter_token_latency_seconds": (ITL_BUCKETS, "Time between consecutive output deltas of a request."),
    "evenflow:e2e_request_latency_seconds": (E2E_BUCKETS, "Time from arrival to the last output token."),
    "evenflow:request_queue_time_seconds": (
        E2E_BUCKETS, "Time a request waited before the engine first scheduled it (when the engine reports it)."),
}


COUNTERS: dict[str, str] = {
    "evenflow:prompt_tokens_total": "Prompt tokens of requests whose prefill finished (refused ones not counted).",
    "evenflow:generation_tokens_total": "Generated tokens delivered.",
}

# Reasons always exported (at 0 until they happen): the engine's admission limits, and no engine.
REJECT_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens", "engine_unavailable")


class HistogramData(Struct, array_like=True):
    """Per-bucket (not cumulative) counts; the last bucket is +Inf."""

    bounds: list[float]
    counts: list[int]
    sum: float = 0.0
    count: int = 0

    @classmethod
    def empty(cls, bounds: list[float]) -> "HistogramData":
        return cls(list(bounds), [0] * (len(bounds) + 1))

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def add(self, other: "HistogramData") -> None:
        if other.bounds != self.bounds:
            return  # a frontend of another version: skip rather than mis-add
        for i, c in enumerate(other.counts):
            self.counts[i] += c
        self.sum += other.sum
        self.count += other.count


class MetricsSnapshot(Struct):
    """One frontend's cumulative request-level metrics plus the engine stats it last saw."""

    frontend: str
    timestamp: float
    counters: dict[str, float]
    finished: dict[str, int]  # finish reason -> requests
    histograms: dict[str, HistogramData]
    engine: SchedulerStats | None = None
    engine_time: float = 0.0
    engines: dict[str, SchedulerStats] = {}  # per engine-core when data parallel, by label
    rejected: dict[str, int] = {}  # refusal reason -> requests (evenflow:request_rejected_total)


class RequestTimer:
    """Timing of one engine request, for TTFT / ITL / e2e."""

    __slots__ = ("arrival", "prompt_tokens", "first_token", "last_token", "num_tokens")

    def __init__(self, arrival: float, prompt_tokens: int = 0) -> None:
        self.arrival = arrival
        self.prompt_tokens = prompt_tokens  # counted at the first token, as vLLM does
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.num_tokens = 0


class FrontendMetrics:
    """This frontend's metrics; ``render()`` gives the merged Prometheus text of all frontends."""

    def __init__(self, model_name: str, metrics_dir: str | None = None, frontend_name: str | None = None) -> None:
        self.model_name = model_name
        self.metrics_dir = Path(metrics_dir) if metrics_dir else None
        self.frontend_name = frontend_name or f"frontend-{os.getpid()}"
        self.counters = {name: 0.0 for name in COUNTERS}
        self.finished: dict[str, int] = {}
        self.rejected: dict[str, int] = {}
        self.histograms = {name: HistogramData.empty(b) for name, (b, _) in HISTOGRAMS.items()}
        self.engine: SchedulerStats | None = None
        self.engine_time = 0.0
        self.engines: dict[str, SchedulerStats] = {}
        self._encoder = msgspec.json.Encoder()
        self._decoder = msgspec.json.Decoder(MetricsSnapshot)

    # -- observation (hot path: a few float operations per delta) ------------------------------

    def on_request_start(self, prompt_tokens: int, arrival: float) -> RequestTimer:
        return RequestTimer(arrival, prompt_tokens)

    def on_tokens(self, timer: RequestTimer, num_tokens: int, now: float) -> None:
        if num_tokens <= 0:
            return
        if timer.first_token is None:
            timer.first_token = now
            self.counters["evenflow:prompt_tokens_total"] += timer.prompt_tokens
            self.histograms["evenflow:time_to_first_token_seconds"].observe(now - timer.arrival)
        elif timer.last_token is not None:
            self.histograms["evenflow:inter_token_latency_seconds"].observe(now - timer.last_token)
        timer.last_token = now
        timer.num_tokens += num_tokens
        self.counters["evenflow:generation_tokens_total"] += num_tokens

    def on_queue_time(self, seconds: float) -> None:
        self.histograms["evenflow:request_queue_time_seconds"].observe(seconds)

    def on_finish(self, timer: RequestTimer, reason: str, now: float) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + 1
        self.histograms["evenflow:e2e_request_latency_seconds"].observe(now - timer.arrival)

    def on_rejected(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def set_engine_stats(self, stats: SchedulerStats | None, when: float | None = None,
                         per_engine: dict[str, SchedulerStats] | None = None) -> None:
        """Record the engine's stats as of ``when`` (now); the same object again is not fresher.
        ``per_engine``: each engine-core's own stats when ``stats`` is a data-parallel total."""
        if stats is not None and stats is not self.engine:
            self.engine = stats
            self.engine_time = time.time() if when is None else when
            self.engines = dict(per_engine or {})

    # -- snapshots and merging ----------------------------------------------------------------

    def snapshot(self) -> MetricsSnapshot:
        return MetricsSnapshot(
            self.frontend_name, time.time(), dict(self.counters), dict(self.finished),
            {k: HistogramData(list(h.bounds), list(h.counts), h.sum, h.count) for k, h in self.histograms.items()},
            self.engine, self.engine_time, dict(self.engines), dict(self.rejected),
        )

    def write_snapshot(self) -> None:
        """Publish this frontend's snapshot to the shared folder (atomic rename)."""
        if self.metrics_dir is None:
            return
        self.metrics_dir.mkdir(parents=True, exist_ok=True)
        path = self.metrics_dir / f"{self.frontend_name}.json"
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(self._encoder.encode(self.snapshot()))
        os.replace(tmp, path)

    def collect(self) -> list[MetricsSnapshot]:
        """Every frontend's snapshot: this one fresh, the others from the shared folder."""
        own = self.snapshot()
        if self.metrics_dir is None:
            return [own]
        self.write_snapshot()
        snaps = [own]
        for path in sorted(self.metrics_dir.glob("*.json")):
            if path.stem == self.frontend_name:
                continue
            try:
                snaps.append(self._decoder.decode(path.read_bytes()))
            except (OSError, msgspec.DecodeError):
                continue  # a half-written or foreign file: skip it this scrape
        return snaps

    def render(self) -> str:
        return render_prometheus(merge_snapshots(self.collect()), self.model_name)


def merge_snapshots(snaps: list[MetricsSnapshot]) -> MetricsSnapshot:
    """Sum request-level metrics; take engine stats from the freshest snapshot."""
    merged = MetricsSnapshot("merged", time.time(), {n: 0.0 for n in COUNTERS}, {},
                             {n: HistogramData.empty(b) for n, (b, _) in HISTOGRAMS.items()})
    for s in snaps:
        for k, v in s.counters.items():
            merged.counters[k] = merged.counters.get(k, 0.0) + v
        for k, v in s.finished.items():
            merged.finished[k] = merged.finished.get(k, 0) + v
        for k, v in s.rejected.items():
            merged.rejected[k] = merged.rejected.get(k, 0) + v
        for k, h in s.histograms.items():
            if k in merged.histograms:
                merged.histograms[k].add(h)
        if s.engine is not None and s.engine_time >= merged.engine_time:
            merged.engine, merged.engine_time, merged.engines = s.engine, s.engine_time, s.engines
    return merged


class _SnapshotCollector:
    """A prometheus_client collector over one merged snapshot (a fresh one per scrape)."""

    def __init__(self, snapshot: MetricsSnapshot, model_name: str) -> None:
        self.snapshot, self.model_name = snapshot, model_name

    def collect(self) -> Iterator[Metric]:
        s, labels, values = self.snapshot, ["model_name"], [self.model_name]
        engine = s.engine or SchedulerStats()
        for m in ENGINE_METRICS:
            family = (GaugeMetricFamily if m.kind == "gauge" else CounterMetricFamily)(m.name, m.help, labels=labels)
            family.add_metric(values, m.value(engine))
            sample_name = family.samples[0].name
            for label, stats in sorted(s.engines.items()):  # data parallel: each engine-core too
                family.add_sample(sample_name, {"model_name": self.model_name, "engine": label}, m.value(stats))
            yield family
        per_pos = CounterMetricFamily("evenflow:spec_decode_num_accepted_tokens_per_pos_total",
                                      "Draft tokens accepted, by position in the draft.",
                                      labels=["model_name", "position"])
        for position, count in enumerate(engine.spec_decode.num_accepted_tokens_per_pos):
            per_pos.add_metric([self.model_name, str(position)], count)
        yield per_pos
        yield token_budget_histogram(engine, labels, values)
        for name, help_text in COUNTERS.items():
            counter = CounterMetricFamily(name, help_text, labels=labels)
            counter.add_metric(values, s.counters.get(name, 0.0))
            yield counter
        success = CounterMetricFamily("evenflow:request_success_total", "Finished requests by finish reason.",
                                      labels=["model_name", "finished_reason"])
        for reason in sorted(set(s.finished) | {"stop", "length", "abort"}):
            success.add_metric([self.model_name, reason], s.finished.get(reason, 0))
        yield success
        rejected = CounterMetricFamily("evenflow:request_rejected_total",
                                       "Requests refused before admission (HTTP 503), by reason.",
                                       labels=["model_name", "reason"])
        for reason in sorted(set(s.rejected) | set(REJECT_REASONS)):
            rejected.add_metric([self.model_name, reason], s.rejected.get(reason, 0))
        yield rejected
        for name, (_, help_text) in HISTOGRAMS.items():
            h = s.histograms[name]
            cumulative = list(itertools.accumulate(h.counts))
            bounds = [*(repr(float(b)) for b in h.bounds), "+Inf"]
            histogram = HistogramMetricFamily(name, help_text, labels=labels)
            histogram.add_metric(values, list(zip(bounds, cumulative)), h.sum)
            yield histogram
        yield grammar_compile_histogram(engine, labels, values)


def render_prometheus(s: MetricsSnapshot, model_name: str) -> str:
    """The Prometheus text exposition format (version 0.0.4) of a merged snapshot."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SnapshotCollector(s, model_name))
    return generate_latest(registry).decode()
