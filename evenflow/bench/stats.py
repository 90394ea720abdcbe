"""Latency and throughput statistics over a run's request records, and their text table.

TTFT: first chunk minus send. ITL: gap between consecutive chunks of one request (a chunk is a
token when streaming). TPOT: (e2e - TTFT) / (output tokens - 1) per request. Goodput: requests per
second that met every SLO given. Groups: "all", plus one per request kind ("steady", "long", ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from evenflow.bench.client import RequestRecord


@dataclass
class Dist:
    """Percentiles of one latency, in milliseconds; all zero when there were no samples."""

    count: int = 0
    mean: float = 0.0
    p50: float = 0.0
    p95: float = 0.0
    p99: float = 0.0
    p999: float = 0.0
    max: float = 0.0


@dataclass
class SLO:
    """Per-request latency objectives in ms; None = not checked."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    itl_ms: float | None = None  # the request's worst gap
    e2e_ms: float | None = None

    def is_set(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.itl_ms, self.e2e_ms))


@dataclass
class GroupStats:
    """One group of requests over the run's span."""

    completed: int
    failed: int
    prompt_tokens: int
    output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_throughput: float  # (prompt + output) tokens / s
    goodput: float | None  # requests / s meeting every SLO set
    ttft: Dist
    tpot: Dist
    itl: Dist
    e2e: Dist


@dataclass
class RunStats:
    """Statistics of one run: ``duration_s`` is first send to last completion."""

    duration_s: float
    groups: dict[str, GroupStats] = field(default_factory=dict)


def dist_ms(samples_s: np.ndarray) -> Dist:
    if samples_s.size == 0:
        return Dist()
    ms = samples_s * 1000.0
    p50, p95, p99, p999 = np.percentile(ms, [50, 95, 99, 99.9])
    return Dist(int(ms.size), float(ms.mean()), float(p50), float(p95), float(p99), float(p999), float(ms.max()))


def request_gaps(records: list[RequestRecord]) -> tuple[np.ndarray, np.ndarray]:
    """All inter-chunk gaps (seconds), and each request's worst gap (0 for single-chunk ones)."""
    lengths = np.array([len(r.token_times) for r in records], dtype=np.int64)
    if lengths.sum() == 0:
        return np.zeros(0), np.zeros(len(records))
    times = np.concatenate([np.asarray(r.token_times, dtype=np.float64) for r in records])
    gaps = np.diff(times)
    # Drop the differences that straddle two requests: index (end of request i) - 1.
    ends = np.cumsum(lengths)[:-1]
    keep = np.ones(gaps.size, dtype=bool)
    inner = ends[(ends > 0) & (ends < times.size)]
    keep[inner - 1] = False
    starts = np.concatenate([[0], ends])
    worst = np.zeros(len(records))
    per_req = np.where(keep, gaps, 0.0)
    for i, (s, n) in enumerate(zip(starts, lengths)):
        if n > 1:
            worst[i] = per_req[s : s + n - 1].max()
    return gaps[keep], worst


def group_stats(records: list[RequestRecord], duration_s: float, slo: SLO) -> GroupStats:
    ok = [r for r in records if r.ok]
    failed = len(records) - len(ok)
    span = max(duration_s, 1e-9)
    ttft = np.array([r.ttft_s for r in ok], dtype=np.float64)
    e2e = np.array([r.end_s - r.start_s for r in ok], dtype=np.float64)
    out = np.array([r.output_tokens for r in ok], dtype=np.float64)
    multi = out > 1
    tpot = (e2e[multi] - ttft[multi]) / (out[multi] - 1)
    itl, worst_gap = request_gaps(ok)
    prompt_tokens = int(sum(r.prompt_len for r in ok))
    output_tokens = int(out.sum())
    goodput = None
    if slo.is_set():
        good = np.ones(len(ok), dtype=bool)
        tpot_all = np.zeros(len(ok))
        tpot_all[multi] = tpot
        for limit, values in ((slo.ttft_ms, ttft), (slo.tpot_ms, tpot_all), (slo.itl_ms, worst_gap), (slo.e2e_ms, e2e)):
            if limit is not None and len(ok):
                good &= values * 1000.0 <= limit
        goodput = float(good.sum()) / span
    return GroupStats(
        completed=len(ok),
        failed=failed,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        request_throughput=len(ok) / span,
        output_throughput=output_tokens / span,
        total_throughput=(prompt_tokens + output_tokens) / span,
        goodput=goodput,
        ttft=dist_ms(ttft),
        tpot=dist_ms(tpot),
        itl=dist_ms(itl),
        e2e=dist_ms(e2e),
    )


def run_stats(records: list[RequestRecord], slo: SLO) -> RunStats:
    """Stats for all requests and for each kind, over the span from first send to last end."""
    if not records:
        return RunStats(0.0)
    duration = max(r.end_s for r in records) - min(r.start_s for r in records)
    stats = RunStats(duration, {"all": group_stats(records, duration, slo)})
    kinds = sorted({r.kind for r in records})
    if len(kinds) > 1:
        for kind in kinds:
            stats.groups[kind] = group_stats([r for r in records if r.kind == kind], duration, slo)
    return stats


def format_table(stats: RunStats) -> str:
    """A fixed-width table: one column per group, one row per number."""
    names = list(stats.groups)
    rows: list[tuple[str, list[str]]] = []

    def add(label: str, get: object, fmt: str = "{:.1f}") -> None:
        cells = []
        for g in stats.groups.values():
            v = get(g)  # type: ignore[operator]
            cells.append("-" if v is None else fmt.format(v))
        rows.append((label, cells))

    add("completed / failed", lambda g: f"{g.completed} / {g.failed}", "{}")
    add("request throughput (req/s)", lambda g: g.request_throughput, "{:.2f}")
    add("output throughput (tok/s)", lambda g: g.output_throughput)
    add("total throughput (tok/s)", lambda g: g.total_throughput)
    add("goodput (req/s)", lambda g: g.goodput, "{:.2f}")
    for metric in ("ttft", "tpot", "itl", "e2e"):
        for q in ("p50", "p95", "p99", "p999", "max"):
            add(f"{metric.upper()} {q} (ms)", lambda g, m=metric, q=q: getattr(getattr(g, m), q))
    width = max(len(r[0]) for r in rows) + 2
    colw = max(12, *(len(n) + 2 for n in names))
    lines = [f"duration {stats.duration_s:.1f} s", "".ljust(width) + "".join(n.rjust(colw) for n in names)]
    lines += [label.ljust(width) + "".join(c.rjust(colw) for c in cells) for label, cells in rows]
    return "\n".join(lines)
