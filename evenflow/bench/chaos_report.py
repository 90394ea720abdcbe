"""The chaos run's table: the ledger, leaks, orphans, RSS, ITL per fault, probe latencies."""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np


def _p(values: list[float], q: float) -> str:
    return f"{np.percentile(values, q):.1f}" if values else "-"


def fault_itl(streams: list[list[float]], faults: list[tuple[str, float]], window_s: float) -> dict[str, list[float]]:
    """Inter-token gaps (ms) of completed streams, by the fault whose window holds both chunks;
    gaps outside every window are the "no fault" baseline."""
    windows = sorted(faults, key=lambda f: f[1])
    starts = np.array([t for _, t in windows]) if windows else np.zeros(0)
    out: dict[str, list[float]] = {}
    for times in streams:
        t = np.asarray(times)
        if len(t) < 2:
            continue
        gaps, ends, begins = np.diff(t) * 1000, t[1:], t[:-1]
        idx = np.searchsorted(starts, begins, side="right") - 1  # the latest fault started before the gap
        for gap, b, e, i in zip(gaps, begins, ends, idx):
            inside = i >= 0 and e <= starts[i] + window_s
            out.setdefault(windows[i][0] if inside else "no fault", []).append(float(gap))
    return out


def render(ledger: Any, leaked: dict[str, int], orphans: list[str], fleet: Any, itl: dict[str, list[float]],
           engine_exits: list[tuple[str, int | None]], wall_s: float, args: argparse.Namespace) -> str:
    lg = ledger
    ended = lg.completed + lg.refused + lg.errored + lg.disconnected + lg.lost
    rows = [
        ("requests sent", lg.sent), ("completed", lg.completed), ("refused with 503", lg.refused),
        ("errored with a clear reason", lg.errored), ("left mid-stream by their client", lg.disconnected),
        ("lost (sent, never ended)", lg.lost + (lg.sent - ended)), ("duplicated outputs", lg.duplicated),
        ("greedy probes equal to idle / different", f"{lg.probe_ok} / {lg.probe_mismatch}"),
        ("KV blocks leaked after quiesce", ", ".join(f"{k}: {v}" for k, v in leaked.items()) or "-"),
        ("orphan processes", len(orphans)),
        ("malformed HTTP bodies: answers", dict(lg.malformed_http)),
        ("malformed wire frames: answers", dict(lg.malformed_wire)),
        ("engine-core exits (fault, code)", engine_exits),
        ("/health ms p50 / p99 / max", f"{_p(lg.health_ms, 50)} / {_p(lg.health_ms, 99)} / {_p(lg.health_ms, 100)}"),
        ("/metrics ms p50 / p99 / max", f"{_p(lg.metrics_ms, 50)} / {_p(lg.metrics_ms, 99)} / {_p(lg.metrics_ms, 100)}"),
        ("/health or /metrics failures (while no engine)", lg.health_fail),
    ]
    out = [f"chaos run: {wall_s:.0f} s wall, --duration {args.duration:g}, {args.clients} clients, "
           f"{args.frontends} frontends, a fault every {args.fault_every:g} s", "",
           "| measure | value |", "|---|---|"]
    out += [f"| {k} | {v} |" for k, v in rows]
    out += ["", "| errors by reason | count |", "|---|--:|"]
    out += [f"| {r} | {c} |" for r, c in lg.reasons.most_common(12)]
    out += ["", "| process | peak RSS MiB | end RSS MiB |", "|---|--:|--:|"]
    out += [f"| {role} | {fleet.rss_peak[role]:.0f} | {fleet.rss_end.get(role, 0):.0f} |" for role in sorted(fleet.rss_peak)]
    out += ["", "| ITL of unaffected streams | gaps | p50 ms | p99 ms |", "|---|--:|--:|--:|"]
    out += [f"| {k} | {len(v)} | {_p(v, 50)} | {_p(v, 99)} |" for k, v in sorted(itl.items())]
    if orphans:
        out += ["", "orphans: " + ", ".join(orphans)]
    return "\n".join(out)
