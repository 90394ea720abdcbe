"""A recording of the steps a worker ran, to replay them into a worker alone (``scripts/replay_steps.py``).

Off unless ``$EVENFLOW_STEP_RECORD`` names a path prefix: then rank 0 writes ``PREFIX.config.json`` (its
``WorkerConfig``), ``PREFIX.frames`` (every message from the engine-core as received: a 4-byte
little-endian length, then the msgpack bytes) and ``PREFIX.steps.jsonl`` (one ``StepTiming`` a step).
Replayed into a ``ModelRunner`` in a process of its own, the frames run the same shapes, block ids and
thread plan with nothing beside the worker, so the two timings of each step tell what the processes
around a served worker cost it, apart from what the steps themselves cost
(docs/results/steadiness.md, set 26: 8-10% on 2 cores).
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import msgspec
import torch

from evenflow.protocol import SchedulerOutput, WorkerConfig

RECORD_ENV = "EVENFLOW_STEP_RECORD"
_LENGTH_BYTES = 4


class StepTiming(msgspec.Struct):
    """One step as the worker saw it."""

    step_id: int
    num_tokens: int
    max_query: int  # the most new tokens of one request: 1 in a decode-only step, 0 in an empty one
    wall_s: float
    cpu_s: float  # user + system time of the whole process: up to threads x wall_s
    involuntary_switches: int  # times the process's threads were preempted during the step
    threads: int

    @property
    def kind(self) -> str:
        if self.max_query == 0:
            return "empty"
        return "decode-only" if self.max_query == 1 else "with a prompt chunk"


class StepClock:
    """Times one step of this process: wall, CPU and preemptions."""

    def __init__(self) -> None:
        self._wall = time.perf_counter()
        self._usage = resource.getrusage(resource.RUSAGE_SELF)

    def stop(self, so: SchedulerOutput) -> StepTiming:
        wall = time.perf_counter() - self._wall
        usage, before = resource.getrusage(resource.RUSAGE_SELF), self._usage
        cpu = usage.ru_utime + usage.ru_stime - before.ru_utime - before.ru_stime
        return StepTiming(so.step_id, so.total_num_scheduled_tokens, max(so.num_scheduled_tokens.values(), default=0),
                          wall, cpu, usage.ru_nivcsw - before.ru_nivcsw, torch.get_num_threads())


class StepRecorder:
    """Writes a recording under ``prefix`` (see the module docstring)."""

    def __init__(self, prefix: Path, config: WorkerConfig) -> None:
        self.prefix = prefix
        Path(f"{prefix}.config.json").write_bytes(msgspec.json.encode(config))
        self._frames: BinaryIO = open(f"{prefix}.frames", "wb")
        self._steps: BinaryIO = open(f"{prefix}.steps.jsonl", "wb")

    @classmethod
    def from_env(cls, config: WorkerConfig) -> StepRecorder | None:
        prefix = os.environ.get(RECORD_ENV)
        return cls(Path(prefix), config) if prefix and config.rank == 0 else None

    def frame(self, data: bytes) -> None:
        self._frames.write(len(data).to_bytes(_LENGTH_BYTES, "little"))
        self._frames.write(data)

    def step(self, timing: StepTiming) -> None:
        self._steps.write(msgspec.json.encode(timing) + b"\n")

    def close(self) -> None:
        self._frames.close()
        self._steps.close()


def read_config(prefix: Path) -> WorkerConfig:
    return msgspec.json.decode(Path(f"{prefix}.config.json").read_bytes(), type=WorkerConfig)


def read_frames(prefix: Path) -> Iterator[bytes]:
    data = Path(f"{prefix}.frames").read_bytes()
    at = 0
    while at < len(data):
        length = int.from_bytes(data[at : at + _LENGTH_BYTES], "little")
        at += _LENGTH_BYTES
        yield data[at : at + length]
        at += length


def read_steps(path: Path) -> list[StepTiming]:
    decode = msgspec.json.Decoder(StepTiming).decode
    return [decode(line) for line in Path(path).read_bytes().splitlines() if line]
