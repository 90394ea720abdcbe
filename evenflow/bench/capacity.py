"""Serving capacity (Sarathi-Serve's measure): the highest Poisson rate whose run keeps P99 ITL and
P99 TTFT under their SLOs, found by doubling until a rate fails, then bisecting."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from evenflow.bench.stats import SLO, RunStats


@dataclass
class Probe:
    """One run at one rate, and whether it met the SLOs."""

    rate: float
    ok: bool
    itl_p99_ms: float
    ttft_p99_ms: float
    failed_requests: int


@dataclass
class Capacity:
    """The highest rate that passed (0 if none did), and every probe made to find it."""

    rate: float
    probes: list[Probe] = field(default_factory=list)


def meets_slo(stats: RunStats, slo: SLO) -> Probe:
    """P99 ITL and P99 TTFT against their SLOs; any failed request fails the probe."""
    g = stats.groups.get("all")
    if g is None or g.completed == 0:
        return Probe(0.0, False, 0.0, 0.0, g.failed if g else 0)
    ok = g.failed == 0
    if slo.itl_ms is not None:
        ok &= g.itl.p99 <= slo.itl_ms
    if slo.ttft_ms is not None:
        ok &= g.ttft.p99 <= slo.ttft_ms
    return Probe(0.0, ok, g.itl.p99, g.ttft.p99, g.failed)


def search_capacity(
    probe_at: Callable[[float], Probe], start_rate: float, max_rate: float, bisect_steps: int
) -> Capacity:
    """Double from ``start_rate`` until a probe fails (or ``max_rate``), then bisect ``bisect_steps`` times."""
    probes: list[Probe] = []

    def probe(rate: float) -> bool:
        p = probe_at(rate)
        p.rate = rate
        probes.append(p)
        return p.ok

    good, bad = 0.0, None
    rate = start_rate
    while rate <= max_rate:
        if probe(rate):
            good, rate = rate, rate * 2
        else:
            bad = rate
            break
    if bad is None:  # even max_rate passed: capacity is at least the last good rate
        return Capacity(good, probes)
    for _ in range(bisect_steps):
        mid = (good + bad) / 2
        if probe(mid):
            good = mid
        else:
            bad = mid
    return Capacity(good, probes)
