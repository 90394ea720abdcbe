"""Worker processes seen from the engine-core: spawn, handshake, broadcast steps, collect results.

Links (the engine binds both, in a private temp dir):

* ``XPUB`` -> every rank's ``SUB``: InitKVCache, SchedulerOutput, WorkerShutdown. XPUB (not PUB)
  so the engine sees each rank's subscription arrive and never broadcasts before all listen.
* ``PULL`` <- every rank's ``PUSH``: WorkerReady and WorkerError from any rank, ModelRunnerOutput
  from rank 0 only.

Workers run ``sys.executable -m evenflow.worker.process`` so this process never imports torch.
With ranks on several hosts (multi_node.py) both links are TCP on ``--master-addr``, secured with
CURVE, and only this host's ranks are spawned here; the others come from ``engine-core --headless``.
Every wait here is sliced so a dead worker is noticed within a fraction of a second.
"""

from __future__ import annotations

import logging
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import msgspec
import zmq

from evenflow.protocol import (
    EngineToWorker, InitKVCache, KVCacheReady, ModelRunnerOutput, SchedulerOutput, WorkerConfig, WorkerError,
    WorkerReady, WorkerShutdown, WorkerToEngine,
)
from evenflow.protocol.lifeline import child_env, runtime_dir
from evenflow.protocol.liveness import recv_ready

from evenflow.core.multi_node import RANK_SUBSCRIPTION, NodeLayout, SecuredLinks
from evenflow.core.step_watchdog import StepWatchdog

log = logging.getLogger("evenflow.core.workers")

_POLL_SLICE_MS = 100
_ERROR_GRACE_S = 1.0  # after a first failure, how long to wait for the other ranks' root causes


class WorkerFailure(RuntimeError):
    """A worker died or reported an error; the message names the rank and the root cause."""


@dataclass
class WorkerGroup:
    """``world_size`` worker processes built from one WorkerConfig template: the multiprocess
    ``Executor`` (evenflow/protocol/executor.py)."""

    ctx: zmq.Context
    template: WorkerConfig
    start_timeout: float = 600.0
    procs: list[subprocess.Popen] = field(default_factory=list)
    layout: NodeLayout | None = None  # ranks on several hosts; None: all here, over ipc://
    watchdog: StepWatchdog | None = None  # told of each step; checked while a result is awaited

    def __post_init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="evenflow-workers-", dir=runtime_dir())
        self._out = self.ctx.socket(zmq.XPUB)
        self._out.setsockopt(zmq.XPUB_VERBOSE, 1)
        self._out.setsockopt(zmq.SNDHWM, 0)  # never drop a step
        self._out.setsockopt(zmq.LINGER, 0)
        self._in = self.ctx.socket(zmq.PULL)
        self._in.setsockopt(zmq.RCVHWM, 0)
        self._in.setsockopt(zmq.LINGER, 0)
        self._links: SecuredLinks | None = None
        if self.layout is None:
            self.input_addr = f"ipc://{self._dir}/steps"
            self.output_addr = f"ipc://{self._dir}/results"
            self._out.bind(self.input_addr)
            self._in.bind(self.output_addr)
        else:
            self.input_addr, self.output_addr = self.layout.steps_addr, self.layout.results_addr
            self._links = SecuredLinks(self.ctx, self.layout, self._out, self._in)
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder(WorkerToEngine).decode
        self._errors: dict[int, WorkerError] = {}

    # ----------------------------------------------------------------------------- start-up

    def start(self) -> list[WorkerReady]:
        """Spawn every rank and wait for its WorkerReady (raises WorkerFailure on death/timeout)."""
        world = self.template.world_size
        if self.layout is not None:
            dist_addr, local = self.layout.dist_init_addr, self.layout.local_ranks()
        else:
            dist_addr, local = (f"tcp://127.0.0.1:{_free_port()}" if world > 1 else ""), range(world)
        for rank in local:
            cfg = msgspec.structs.replace(self.template, rank=rank, dist_init_addr=dist_addr,
                                          engine_input_addr=self.input_addr,
                                          engine_output_addr=self.output_addr,
                                          secure_link=self.layout is not None)
            self.procs.append(spawn_worker(cfg, self.layout.worker_env() if self.layout else None))
        readies: dict[int, WorkerReady] = {}
        subscribed = 0
        deadline = time.monotonic() + self.start_timeout
        poller = zmq.Poller()
        poller.register(self._out, zmq.POLLIN)
        poller.register(self._in, zmq.POLLIN)
        while len(readies) < world or subscribed < world:
            if time.monotonic() > deadline:
                missing = sorted(set(range(world)) - set(readies))
                raise WorkerFailure(f"workers did not finish start-up within {self.start_timeout:.0f} s "
                                    f"(no WorkerReady from ranks {missing}, {subscribed}/{world} subscribed)")
            events = dict(poller.poll(_POLL_SLICE_MS))
            if self._out in events:
                if self._out.recv() == RANK_SUBSCRIPTION:  # not a headless host's watch (multi_node.py)
                    subscribed += 1
            if self._in in events and (msg := self._poll_in(0)) is not None:
                if isinstance(msg, WorkerReady):
                    readies[msg.rank] = msg
                elif isinstance(msg, WorkerError):
                    self._errors[msg.rank] = msg
                    self._raise_failure()
            if not events:
                self.check_alive()
        return [readies[r] for r in range(world)]

    def init_kv_cache(self, num_blocks: int) -> None:
        """Have every rank allocate ``num_blocks`` blocks and wait until each has (KVCacheReady), so
        that the engine reports ready with its memory in place (raises WorkerFailure)."""
        self._send(InitKVCache(num_blocks))
        waiting = set(range(self.template.world_size))
        deadline = time.monotonic() + self.start_timeout
        while waiting:
            if time.monotonic() > deadline:
                raise WorkerFailure(f"ranks {sorted(waiting)} did not allocate their KV cache within "
                                    f"{self.start_timeout:.0f} s")
            if (msg := self._poll_in(_POLL_SLICE_MS)) is not None:
                if isinstance(msg, KVCacheReady):
                    waiting.discard(msg.rank)
                elif isinstance(msg, WorkerError):
                    self._errors[msg.rank] = msg
                    self._raise_failure()
            else:
                self.check_alive()

    # ----------------------------------------------------------------------------- steps

    def send_step(self, so: SchedulerOutput) -> None:
        """Broadcast one step to every rank (non-blocking: the PUB queue is unbounded)."""
        self._send(so)
        if self.watchdog is not None:
            self.watchdog.sent(so)

    def recv_output(self, step_id: int) -> ModelRunnerOutput:
        """Wait for rank 0's result of ``step_id``; raise WorkerFailure if any rank fails first (and
        StepTimeout when the watchdog finds the step past --step-timeout)."""
        while True:
            if (msg := self._poll_in(_POLL_SLICE_MS)) is not None:
                if isinstance(msg, ModelRunnerOutput):
                    if msg.step_id != step_id:
                        raise WorkerFailure(f"worker rank 0 answered step {msg.step_id}, expected {step_id}")
                    if self.watchdog is not None:
                        self.watchdog.done(step_id)
                    return msg
                if isinstance(msg, WorkerError):
                    self._errors[msg.rank] = msg
                    self._raise_failure()
            else:
                self.check_alive()
                if self.watchdog is not None:
                    self.watchdog.check(step_id)

    def check_alive(self) -> None:
        """Raise WorkerFailure when any rank here has exited, or a host with ranks is lost."""
        if any(p.poll() is not None for p in self.procs) or (self._links is not None and self._links.check()):
            self._raise_failure()

    def _poll_in(self, timeout_ms: int) -> WorkerToEngine | None:
        """The ranks' next message, waiting up to ``timeout_ms``; None if none came."""
        frame = recv_ready(self._in, timeout_ms)
        return None if frame is None else self._decode(frame.buffer)

    def _send(self, msg: EngineToWorker) -> None:
        self._out.send(self._encode(msg), copy=False)

    def _raise_failure(self) -> None:
        """Collect every rank's root cause for a short grace period, then raise one message."""
        deadline = time.monotonic() + _ERROR_GRACE_S
        while time.monotonic() < deadline:
            if (msg := self._poll_in(50)) is not None:
                if isinstance(msg, WorkerError):
                    self._errors[msg.rank] = msg
            elif all(p.poll() is not None for p in self.procs) and (self._links is None or self._links.check()):
                break  # every local rank is gone (and, across hosts, the lost host is known)
        parts = []
        local = dict(zip(self.layout.local_ranks() if self.layout else range(len(self.procs)), self.procs))
        for rank in sorted(set(local) | set(self._errors)):
            err = self._errors.get(rank)
            code = local[rank].poll() if rank in local else None
            if err is not None:
                where = f" at step {err.step_id}" if err.step_id >= 0 else ""
                parts.append(f"worker rank {rank} failed{where}: {err.message}")
            elif code is not None:
                parts.append(f"worker rank {rank} (pid {local[rank].pid}) {describe_exit(code)}")
        if self._links is not None and self._links.check():
            parts.append(self._links.lost or "")
        raise WorkerFailure("; ".join(parts) or "a worker failed without a reason")

    # ----------------------------------------------------------------------------- shutdown

    def shutdown(self, timeout: float = 5.0) -> None:
        """Ask every rank to exit, kill stragglers (workers ignore SIGTERM); remove the socket folder."""
        try:
            self._send(WorkerShutdown())
        except zmq.ZMQError:
            pass
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("worker pid %d did not exit in %.1f s: killing it", p.pid, timeout)
                p.kill()
                p.wait()
        if self._links is not None:
            self._links.close()
        self._out.close(0)
        self._in.close(0)
        shutil.rmtree(self._dir, ignore_errors=True)


def spawn_worker(cfg: WorkerConfig, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start one rank; a secured one reads the shared secret from ``env``, never from its argv."""
    cmd = [sys.executable, "-m", "evenflow.worker.process", "--config", msgspec.json.encode(cfg).decode()]
    # EVENFLOW_PARENT_PID: the rank dies with this process even if it dies before the rank starts.
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=child_env(env))
    log.info("started worker rank %d (pid %d)", cfg.rank, proc.pid)
    return proc


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
