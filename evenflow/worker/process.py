"""A worker process: a ZMQ loop around one ModelRunner (one rank).

    python -m evenflow.worker.process --config '{"model": "...", "rank": 0, ...}'   (WorkerConfig JSON)

Protocol with the engine-core (see evenflow/protocol/README.md, "engine-core <-> workers"): connect SUB to
``engine_input_addr`` and PUSH to ``engine_output_addr``; load the model; send WorkerReady with the
number of KV blocks this rank can hold; allocate what InitKVCache says; then run every
SchedulerOutput in order (rank 0 sends each ModelRunnerOutput back) until WorkerShutdown.
Any exception is reported as WorkerError (the root cause travels to the frontends) before exit 1.
The process also exits when its parent (the engine-core, or a headless launcher) dies, so nothing
is left behind. Ranks on another host than the engine-core (``secure_link``) connect over TCP as
CURVE clients keyed by the shared secret in ``$EVENFLOW_DIST_SECRET``, and stop with an error when
their connection to the engine-core drops.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import Sequence

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from evenflow.protocol import (
    EngineToWorker, InitKVCache, KVCacheReady, ModelRunnerOutput, SchedulerOutput, WorkerConfig, WorkerError,
    WorkerReady, WorkerShutdown,
)
from evenflow.protocol.link_auth import SECRET_ENV, derive_link_keys, secure_client

from evenflow.protocol.lifeline import die_with_parent
from evenflow.protocol.liveness import recv_ready

from evenflow.worker.fault_injection import FaultInjector
from evenflow.worker.omp_env import quiet_omp_waits

log = logging.getLogger("evenflow.worker.process")

_PARENT_POLL_S = 0.5
LINK_GRACE_S = 5.0  # a step link down this long is lost (ZMQ reconnects a link whose peer is alive)


def watch_parent(parent_pid: int) -> None:
    """Exit hard as soon as the engine-core is gone (we are re-parented)."""

    def loop() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(_PARENT_POLL_S)

    threading.Thread(target=loop, name="parent-watch", daemon=True).start()


class StepTracker:
    """The step being executed, so a failure report can name it."""

    step_id: int = -1


def connect(ctx: zmq.Context, kind: int, address: str, cfg: WorkerConfig) -> zmq.Socket:
    """A socket to the engine-core; over TCP to another host it is a CURVE client watching the host."""
    sock = ctx.socket(kind)
    if cfg.secure_link:
        secure_client(sock, derive_link_keys(os.environ.get(SECRET_ENV, "").encode()))
    sock.setsockopt(zmq.SNDHWM if kind == zmq.PUSH else zmq.RCVHWM, 0)
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(address)
    return sock


class LinkState:
    """Whether the step link to the engine-core is lost: it came up, went down, and stayed down past
    ``LINK_GRACE_S``. ZMQ reconnects a dropped link by itself, and the monitor's events wait in a queue
    while the worker loads its model, so a drop is read late, often after the link came back (a CI run's
    headless worker died of one at start-up while its engine-core waited for it)."""

    def __init__(self) -> None:
        self.up = False
        self.down_since: float | None = None

    def note(self, handshake: bool, now: float) -> None:
        """A monitor event read at ``now``: a handshake that succeeded, else a disconnect."""
        if handshake:
            self.up, self.down_since = True, None
        elif self.up and self.down_since is None:
            self.down_since = now

    def lost(self, now: float) -> bool:
        return self.down_since is not None and now - self.down_since > LINK_GRACE_S


class EngineWatch:
    """Over TCP: the engine-core is lost when the step link, once up, stays down (``LinkState``)."""

    def __init__(self, sub: zmq.Socket) -> None:
        self._monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        self._state = LinkState()
        self._endpoint = ""

    def recv(self, sub: zmq.Socket) -> zmq.Frame:
        while True:
            frame = recv_ready(sub, 250)
            if frame is not None:
                return frame
            while self._monitor.poll(0):
                event = recv_monitor_message(self._monitor)
                self._state.note(event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED, time.monotonic())
                self._endpoint = event["endpoint"].decode(errors="replace")
            if self._state.lost(time.monotonic()):
                raise ConnectionError(f"lost the engine-core at {self._endpoint}")

    def close(self) -> None:
        self._monitor.close(0)


def serve(cfg: WorkerConfig, ctx: zmq.Context, tracker: StepTracker) -> None:
    """Run the handshake and the step loop until WorkerShutdown (raises on any failure)."""
    from evenflow.worker.runner import ModelRunner  # imports torch: after the sockets are up
    from evenflow.worker.step_record import StepClock, StepRecorder

    sub = connect(ctx, zmq.SUB, cfg.engine_input_addr, cfg)
    push = connect(ctx, zmq.PUSH, cfg.engine_output_addr, cfg)
    watch = EngineWatch(sub) if cfg.secure_link else None
    encode = msgspec.msgpack.Encoder().encode
    decode = msgspec.msgpack.Decoder(EngineToWorker).decode
    recorder = StepRecorder.from_env(cfg)  # None unless $EVENFLOW_STEP_RECORD is set
    runner = ModelRunner(cfg)
    faults = FaultInjector()  # test-only; a no-op unless its variable is set
    try:
        num_blocks = runner.determine_num_kv_blocks()
        push.send(encode(WorkerReady(cfg.rank, num_blocks, runner.block_size, runner.attention_backend,
                                     str(runner.dtype), str(runner.device))))
        idle_since = time.perf_counter()
        while True:
            frame = sub.recv(copy=False) if watch is None else watch.recv(sub)
            wait_s = time.perf_counter() - idle_since
            if recorder is not None:
                recorder.frame(frame.bytes)
            msg = decode(frame.buffer)
            if isinstance(msg, SchedulerOutput):
                tracker.step_id = msg.step_id
                faults.before_step()
                if recorder is None:
                    out = runner.execute_model(msg)
                else:
                    clock = StepClock()
                    out = runner.execute_model(msg)
                    recorder.step(clock.stop(msg, out is not None and out.contended))
                if cfg.rank == 0:
                    if out is None:  # nothing to sample this step: still answer, the engine waits
                        out = ModelRunnerOutput(msg.step_id, [], [])
                    out.wait_s = wait_s
                    push.send(encode(out), copy=False)
            elif isinstance(msg, InitKVCache):
                runner.init_kv_cache(msg.num_kv_blocks)
                push.send(encode(KVCacheReady(cfg.rank, msg.num_kv_blocks)))
                # Start-up leaves millions of long-lived objects (torch, the model) that every full
                # garbage collection would rescan: such collections took 46-91 ms here at start-up.
                gc.freeze()
            elif isinstance(msg, WorkerShutdown):
                return
            idle_since = time.perf_counter()
    finally:
        if recorder is not None:
            recorder.close()
        runner.shutdown()
        if watch is not None:
            watch.close()
        push.close(linger=2000)
        sub.close(0)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of one worker rank; returns the exit code."""
    parser = argparse.ArgumentParser(prog="evenflow-worker", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="WorkerConfig as JSON")
    args = parser.parse_args(argv)
    cfg = msgspec.json.decode(args.config, type=WorkerConfig)
    quiet = quiet_omp_waits()  # before torch loads the OpenMP runtime (serve imports it)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s worker{cfg.rank} %(levelname)s %(message)s")
    if quiet and cfg.rank == 0:
        log.info("OpenMP threads spin briefly, then sleep, between regions (%s): long spins collapse "
                 "when a core is shared",
                 " ".join(f"{k}={v}" for k, v in quiet.items()))
    # Ctrl-C in a terminal (or a SIGTERM to the process group) reaches every process: the
    # engine-core decides when we stop (WorkerShutdown), and we exit by ourselves if it dies.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # The engine-core names itself (EVENFLOW_PARENT_PID): a worker whose engine-core died while it
    # was starting is already re-parented, and os.getppid() would then watch the wrong process.
    if not die_with_parent(signal.SIGKILL):
        watch_parent(os.getppid())
    ctx = zmq.Context()
    tracker = StepTracker()
    try:
        serve(cfg, ctx, tracker)
        return 0
    except BaseException as e:  # report the root cause to the engine before dying
        traceback.print_exc()
        text = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        push = connect(ctx, zmq.PUSH, cfg.engine_output_addr, cfg)
        push.send(msgspec.msgpack.encode(WorkerError(cfg.rank, text, tracker.step_id)))
        push.close(linger=2000)
        return 1
    finally:
        ctx.destroy(linger=0)


if __name__ == "__main__":
    sys.exit(main())
