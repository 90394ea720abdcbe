"""Replay a worker's recorded steps (``evenflow/worker/step_record.py``) into a ``ModelRunner`` with
nothing beside it, and compare each kind of step's time served and replayed.

The process must set its OpenMP waits before torch loads, as a worker does
(``evenflow.worker.omp_env.quiet_omp_waits``): ``scripts/replay_steps.py`` does.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from pathlib import Path

import msgspec

from evenflow.protocol import EngineToWorker, InitKVCache, ModelRunnerOutput, SchedulerOutput, WorkerShutdown
from evenflow.worker.runner import ModelRunner
from evenflow.worker.step_record import StepClock, StepTiming, read_config, read_frames


@dataclass
class Replayed:
    timings: list[StepTiming]
    outputs: list[ModelRunnerOutput | None]  # what each step returned, in order


def replay(prefix: Path) -> Replayed:
    """Run every recorded message in order, as the worker process does (``evenflow/worker/process.py``)."""
    config = read_config(prefix)
    if config.world_size > 1:
        raise ValueError(f"{prefix} is a tensor-parallel rank's recording: its steps need the other ranks")
    runner = ModelRunner(config)
    runner.determine_num_kv_blocks()
    decode = msgspec.msgpack.Decoder(EngineToWorker).decode
    result = Replayed([], [])
    try:
        for frame in read_frames(prefix):
            msg = decode(frame)
            if isinstance(msg, InitKVCache):
                runner.init_kv_cache(msg.num_kv_blocks)
                gc.freeze()  # as the worker does once its cache is up
            elif isinstance(msg, SchedulerOutput):
                clock = StepClock()
                result.outputs.append(runner.execute_model(msg))
                result.timings.append(clock.stop(msg))
            elif isinstance(msg, WorkerShutdown):
                break
    finally:
        runner.shutdown()
    return result


@dataclass
class KindComparison:
    """One kind of step, served against replayed (means over the steps both ran). Steps whose thread
    counts differ (the thread rule fell back in one run and not in the other) form kinds of their own."""

    kind: str
    steps: int
    served_ms: float
    replayed_ms: float
    served_cpu_per_wall: float
    replayed_cpu_per_wall: float
    served_switches: float  # involuntary context switches a step
    replayed_switches: float

    @property
    def ratio(self) -> float:
        return self.served_ms / self.replayed_ms if self.replayed_ms > 0 else float("nan")


def compare(served: list[StepTiming], replayed: list[StepTiming]) -> list[KindComparison]:
    """Pair the two timings of each step by its id, grouped by kind (steps of no tokens left out; served
    steps the worker marked contended, another process on a core, a kind of their own)."""
    by_id = {t.step_id: t for t in replayed}
    groups: dict[str, list[tuple[StepTiming, StepTiming]]] = {}
    for s in served:
        r = by_id.get(s.step_id)
        if r is not None and s.kind != "empty":
            kind = s.kind if s.threads == r.threads else f"{s.kind}, {s.threads} / {r.threads} threads"
            kind += ", contended" if s.contended else ""
            groups.setdefault(kind, []).append((s, r))
    rows = []
    for kind, pairs in groups.items():
        n = len(pairs)
        s_wall, r_wall = sum(s.wall_s for s, _ in pairs), sum(r.wall_s for _, r in pairs)
        rows.append(KindComparison(
            kind=kind, steps=n, served_ms=1e3 * s_wall / n, replayed_ms=1e3 * r_wall / n,
            served_cpu_per_wall=sum(s.cpu_s for s, _ in pairs) / s_wall if s_wall else 0.0,
            replayed_cpu_per_wall=sum(r.cpu_s for _, r in pairs) / r_wall if r_wall else 0.0,
            served_switches=sum(s.involuntary_switches for s, _ in pairs) / n,
            replayed_switches=sum(r.involuntary_switches for _, r in pairs) / n))
    return rows


def format_comparison(rows: list[KindComparison]) -> str:
    lines = ["| steps | n | served ms | replayed ms | served / replayed | CPU / wall, served / replayed "
             "| involuntary switches a step, served / replayed |", "|---|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        lines.append(f"| {r.kind} | {r.steps} | {r.served_ms:.2f} | {r.replayed_ms:.2f} | {r.ratio:.3f} "
                     f"| {r.served_cpu_per_wall:.2f} / {r.replayed_cpu_per_wall:.2f} "
                     f"| {r.served_switches:.1f} / {r.replayed_switches:.1f} |")
    return "\n".join(lines)
