"""A recording of the steps a worker ran, to replay them into a worker alone (``scripts/replay_steps.py``).

Off unless ``$EVENFLOW_STEP_RECORD`` names a path prefix: then a worker that is alone (no tensor
parallelism: the other ranks could not be replayed with it) writes ``PREFIX.config.json`` (its
``WorkerConfig``), ``PREFIX.frames`` (every message from the engine-core as received: a 4-byte
little-endian length, then the msgpack bytes) and ``PREFIX.steps.jsonl`` (one ``StepTiming`` a step),
each flushed per step so a killed worker leaves a recording up to its last step. A prefix already
recorded (another engine-core of a data-parallel server) gets the worker's pid appended.
Replayed into a ``ModelRunner`` in a process of its own, the frames run the same shapes and block ids
with nothing beside the worker (the thread count follows the replay's own measurements), so the two
timings of each step tell what the processes around a served worker cost it, apart from what the
steps themselves cost (docs/results/steadiness.md, set 26: 8-10% on 2 cores).
"""

from __future__ import annotations

import logging
import os
import resource
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import msgspec
import torch

from evenflow.protocol import SchedulerOutput, WorkerConfig

log = logging.getLogger("evenflow.worker.step_record")

RECORD_ENV = "EVENFLOW_STEP_RECORD"
_LENGTH_BYTES = 4


class StepTiming(msgspec.Struct):
    """One step as the worker saw it."""

    step_id: int
    num_tokens: int
    max_query: int  # the most new tokens of one request, drafts left out: 1 in a decode-only step, 0 in an empty one
    wall_s: float
    cpu_s: float  # user + system time of the whole process: up to threads x wall_s
    involuntary_switches: int  # times the process's threads were preempted during the step
    threads: int
    contended: bool = False  # on every core while a core was taken (ModelRunnerOutput.contended)

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

    def stop(self, so: SchedulerOutput, contended: bool = False) -> StepTiming:
        wall = time.perf_counter() - self._wall
        usage, before = resource.getrusage(resource.RUSAGE_SELF), self._usage
        cpu = usage.ru_utime + usage.ru_stime - before.ru_utime - before.ru_stime
        drafts = so.num_draft_slots
        max_query = max((n - drafts.get(r, 0) for r, n in so.num_scheduled_tokens.items()), default=0)
        return StepTiming(so.step_id, so.total_num_scheduled_tokens, max_query, wall, cpu,
                          usage.ru_nivcsw - before.ru_nivcsw, torch.get_num_threads(), contended)


class StepRecorder:
    """Writes a recording under ``prefix`` (see the module docstring)."""

    def __init__(self, prefix: Path, config: WorkerConfig) -> None:
        if Path(f"{prefix}.config.json").exists():
            prefix = Path(f"{prefix}.{os.getpid()}")
        self.prefix = prefix
        Path(f"{prefix}.config.json").write_bytes(msgspec.json.encode(config))
        log.info("recording every step to %s.frames (replay: scripts/replay_steps.py %s)", prefix, prefix)
        self._frames: BinaryIO = open(f"{prefix}.frames", "wb")
        self._steps: BinaryIO = open(f"{prefix}.steps.jsonl", "wb")

    @classmethod
    def from_env(cls, config: WorkerConfig) -> StepRecorder | None:
        prefix = os.environ.get(RECORD_ENV)
        if not prefix:
            return None
        if config.world_size > 1:
            log.warning("%s is set, but a tensor-parallel rank cannot be replayed alone: not recording", RECORD_ENV)
            return None
        return cls(Path(prefix), config)

    def frame(self, data: bytes) -> None:
        self._frames.write(len(data).to_bytes(_LENGTH_BYTES, "little"))
        self._frames.write(data)

    def step(self, timing: StepTiming) -> None:
        self._steps.write(msgspec.json.encode(timing) + b"\n")
        self._frames.flush()
        self._steps.flush()

    def close(self) -> None:
        self._frames.close()
        self._steps.close()


def read_config(prefix: Path) -> WorkerConfig:
    return msgspec.json.decode(Path(f"{prefix}.config.json").read_bytes(), type=WorkerConfig)


def read_frames(prefix: Path) -> Iterator[bytes]:
    """The recorded messages in order; a last one cut short (a worker killed while writing it) is left out."""
    data = Path(f"{prefix}.frames").read_bytes()
    at = 0
    while at + _LENGTH_BYTES <= len(data):
        length = int.from_bytes(data[at : at + _LENGTH_BYTES], "little")
        at += _LENGTH_BYTES
        if at + length > len(data):
            log.warning("%s.frames ends inside a message: replaying the %d bytes before it", prefix, at - _LENGTH_BYTES)
            return
        yield data[at : at + length]
        at += length


def read_steps(prefix: Path) -> list[StepTiming]:
    """The served timings; a last line cut short is left out."""
    decode = msgspec.json.Decoder(StepTiming).decode
    lines = Path(f"{prefix}.steps.jsonl").read_bytes().split(b"\n")
    return [decode(line) for line in lines[:-1] if line]  # the text after the last newline is unfinished
