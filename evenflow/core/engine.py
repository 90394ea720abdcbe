"""EngineCore: the busy loop that takes inputs, schedules, dispatches to workers, applies results.

Overlap (``async_scheduling``): up to two steps are in flight. While the workers run step N the
loop schedules step N+1 and sends it, then waits for N's results, applies them and schedules N+2.
The scheduler counts a placeholder for each token step N will sample; the worker fills those
tokens from its own last samples; requests that finished in N have their N+1 work discarded by
the scheduler. With overlap off the loop is schedule -> send -> wait -> apply.

Sockets and msgpack for frontends live on FrontendLink's threads; this loop only moves Structs.
"""

from __future__ import annotations

import logging
import queue
import time
import uuid
from collections import deque
from dataclasses import dataclass

import zmq

from evenflow.protocol import (
    ERR_DUPLICATE_ID, ERR_ENGINE_SHUTDOWN, ERR_INVALID_REQUEST, ERR_OVERLOADED, ERR_REQUEST_TIMEOUT, ERR_WORKER_DIED, PROTOCOL_VERSION, Abort, AddRequest, Error,
    ModelRunnerOutput, Outputs, Ready, RequestOutput, SchedulerOutput, SchedulerStats, UtilityCall,
    UtilityResult, WorkerConfig,
)
from evenflow.protocol.gguf_tokenizer import tokenizer_json_source

from evenflow.core.admission import AdmissionLimits
from evenflow.core.sched.config import SchedulerConfig
from evenflow.core.deadlines import Deadlines, check_timeout
from evenflow.core.engine_config import EngineConfig
from evenflow.core.frontend_link import ClientGone, ClientMessage, FrontendLink
from evenflow.core.kv.events import KVEventLog
from evenflow.core.model_info import ModelInfo
from evenflow.core.request import Request
from evenflow.core.routing import RequestRouter
from evenflow.core.step_timing import StepTiming
from evenflow.core.sched.scheduler import Scheduler
from evenflow.core.multi_node import NodeLayout
from evenflow.core.sched.structured_output import StructuredOutputManager
from evenflow.core.workers import WorkerFailure, WorkerGroup, worker_template

log = logging.getLogger("evenflow.core.engine")

ERR_INTERNAL = "internal_error"  # a bug in the engine-core itself (listed in evenflow/protocol/README.md)
_IDLE_WAKEUP_S = 0.25  # how often an idle loop checks workers and the stop flag


@dataclass
class _InFlight:
    so: SchedulerOutput
    after_idle: bool  # the workers were idle because there was no work, not because of us


class EngineCore:
    """One engine-core: workers, scheduler and the frontend ROUTER. ``run()`` returns an exit code."""

    def __init__(self, cfg: EngineConfig, info: ModelInfo) -> None:
        self.cfg = cfg
        self.info = info
        self.max_model_len = cfg.max_model_len or info.max_model_len
        self._ctx = zmq.Context()
        self._stop_reason: str | None = None
        self._depth = 2 if cfg.async_scheduling else 1
        self._in_flight: deque[_InFlight] = deque()
        self._router = RequestRouter()
        self._pending_finished: list[str] = []  # finished ids of steps that were not sent
        self._pending_preempted: list[str] = []
        self._was_idle = True
        self._times = StepTiming()
        self._admission = AdmissionLimits(cfg.max_num_queued_reqs, cfg.max_num_queued_tokens)
        self._deadlines = Deadlines()
        layout = NodeLayout.from_config(cfg) if cfg.nnodes > 1 else None  # ranks on several hosts
        self.workers = WorkerGroup(self._ctx, self._worker_template(), cfg.worker_start_timeout, layout=layout)
        self.scheduler: Scheduler | None = None
        self.link: FrontendLink | None = None
        self._kv_events: KVEventLog | None = None  # prefix-cache changes for routing frontends

    def _worker_template(self) -> WorkerConfig:
        return worker_template(self.cfg, self.info.model_path, self.max_model_len)

    # ----------------------------------------------------------------------------- start-up

    def start(self) -> Ready:
        """Start workers, size the KV cache (min over ranks), build the scheduler, bind the ROUTER."""
        readies = self.workers.start()
        block_sizes = {r.block_size for r in readies}
        if len(block_sizes) != 1:
            raise ValueError(f"workers disagree on the block size: {sorted(block_sizes)}")
        # The attention backend may round the requested block size; the workers' value is the truth.
        self.block_size = block_sizes.pop()
        num_blocks = min(r.num_kv_blocks for r in readies)
        if self.cfg.num_kv_blocks is not None:
            num_blocks = min(num_blocks, self.cfg.num_kv_blocks)
        sched_cfg = SchedulerConfig(
            num_kv_blocks=num_blocks, max_num_batched_tokens=self.cfg.max_num_batched_tokens,
            max_num_seqs=self.cfg.max_num_seqs, max_model_len=self.max_model_len, block_size=self.block_size,
            long_prefill_token_threshold=self.cfg.long_prefill_token_threshold, policy=self.cfg.scheduling_policy,
            enable_prefix_caching=self.cfg.enable_prefix_caching, target_itl_ms=self.cfg.target_itl_ms,
            max_num_partial_prefills=self.cfg.max_num_partial_prefills,
            max_long_partial_prefills=self.cfg.max_long_partial_prefills, speculative_config=self.cfg.speculative_config)
        sched_cfg.validate()
        self.workers.init_kv_cache(num_blocks)
        # A finished grammar compile wakes an idle loop through the inbox (None: no message).
        grammars = StructuredOutputManager(tokenizer_json_source(self.info.model_path), self.info.vocab_size,
                                           self.info.eos_token_ids, wake=lambda: self.link.inbox.put(None))  # type: ignore[union-attr]
        grammars.prepare()
        self.scheduler = Scheduler(sched_cfg, grammars)
        if self.cfg.enable_prefix_caching:
            self._kv_events = self.scheduler.kv_cache_manager.pool.events = KVEventLog()
        ready = Ready(PROTOCOL_VERSION, self.info.model_name, self.info.model_path, self.max_model_len,
                      self.info.vocab_size, list(self.info.eos_token_ids), self.block_size, num_blocks,
                      self.cfg.max_num_batched_tokens, uuid.uuid4().hex[:12], self.cfg.max_frame_bytes,
                      list(self.info.model_aliases))
        self.link = FrontendLink(self._ctx, self.cfg.listen, ready, max_frame_bytes=self.cfg.max_frame_bytes,
                                 client_timeout=self.cfg.client_timeout, curve_keys=self.cfg.curve_keys)
        self.link.start()
        log.info("workers ready: %s; %d KV blocks of %d tokens", readies, num_blocks, self.block_size)
        return ready

    def request_stop(self, reason: str) -> None:
        """Ask the loop to shut down gracefully (safe from a signal handler: sets one attribute)."""
        self._stop_reason = reason

    # ----------------------------------------------------------------------------- the loop

    def run(self) -> int:
        """Serve until stopped (exit 0) or until a worker fails (exit 1)."""
        assert self.scheduler is not None and self.link is not None, "call start() first"
        try:
            progressed = True
            while self._stop_reason is None:
                # Block on the inbox when there is nothing to do, or when the scheduler has requests
                # it cannot run yet (e.g. too big for free blocks): only an input can change that.
                busy = bool(self._in_flight) or (progressed and self.scheduler.has_unfinished_requests())
                self._take_inputs(block=not busy)
                if self._deadlines:
                    self._expire(time.monotonic())
                progressed = self._step()
            self._shutdown_gracefully(self._stop_reason)
            return 0
        except WorkerFailure as e:
            log.error("%s", e)
            self._fail_everyone(Error(ERR_WORKER_DIED, str(e), fatal=True))
            return 1
        except Exception as e:
            log.exception("engine-core failed")
            self._fail_everyone(Error(ERR_INTERNAL, f"engine-core failed: {type(e).__name__}: {e}",
                                      fatal=True))
            return 1
        finally:
            self.link.close()
            if self.scheduler.structured_output is not None:
                self.scheduler.structured_output.shutdown()
            self.workers.shutdown(timeout=1.0 if self._stop_reason is None else 5.0)
            self._ctx.destroy(linger=0)

    def _take_inputs(self, block: bool) -> None:
        inbox = self.link.inbox  # type: ignore[union-attr]
        if block:
            try:
                self._on_input(inbox.get(timeout=_IDLE_WAKEUP_S))
            except queue.Empty:
                self.workers.check_alive()
                return
        while True:
            try:
                self._on_input(inbox.get_nowait())
            except queue.Empty:
                return

    def _step(self) -> bool:
        """Schedule and/or apply one step; return whether anything moved."""
        sched = self.scheduler
        assert sched is not None
        scheduled = False
        if len(self._in_flight) < self._depth and sched.has_unfinished_requests():
            so = sched.schedule()
            for error in sched.take_grammar_failures():  # the request is gone: tell its client why
                self._send_request_error(error)
            if so.total_num_scheduled_tokens > 0:
                self._send(so)
                scheduled = True
            else:  # nothing to run: carry the bookkeeping to the next step that is sent
                self._pending_finished.extend(so.finished_req_ids)
                self._pending_preempted.extend(so.preempted_req_ids)
        if self._in_flight and (len(self._in_flight) >= self._depth or not scheduled):
            item = self._in_flight.popleft()
            mro = self.workers.recv_output(item.so.step_id)
            if item.after_idle:
                mro.wait_s = 0.0  # the clients' silence, not part of the step (see StepTiming)
            outputs = sched.update_from_output(item.so, mro)
            self._account(mro, item.after_idle)
            self._publish(outputs)
            return True
        return scheduled

    def _send(self, so: SchedulerOutput) -> None:
        if self._pending_finished:
            so.finished_req_ids = self._pending_finished + list(so.finished_req_ids)
            self._pending_finished = []
        if self._pending_preempted:
            so.preempted_req_ids = self._pending_preempted + list(so.preempted_req_ids)
            self._pending_preempted = []
        self.workers.send_step(so)
        self._in_flight.append(_InFlight(so, after_idle=self._was_idle and not self._in_flight))
        self._was_idle = False

    def _account(self, mro: ModelRunnerOutput, after_idle: bool) -> None:
        self._times.add_worker_step(mro, after_idle)
        if not self._in_flight and not self.scheduler.has_unfinished_requests():  # type: ignore[union-attr]
            self._was_idle = True

    def stats(self) -> SchedulerStats:
        """The scheduler's stats with the engine-measured timing split filled in."""
        return self._times.fill(self.scheduler.get_stats())  # type: ignore[union-attr]

    def _publish(self, outputs: list[RequestOutput]) -> None:
        """Route outputs to the clients that asked (one Outputs per client), with fresh stats."""
        stats = self.stats()
        self.link.set_stats(stats)  # type: ignore[union-attr]
        now = time.time()
        for identity, outs in self._router.route(outputs).items():
            self.link.send(identity, Outputs(outs, stats, now))  # type: ignore[union-attr]
        self._report_kv_events(stats, force=not self.scheduler.has_unfinished_requests())  # type: ignore[union-attr]

    def _report_kv_events(self, stats: SchedulerStats, force: bool) -> None:
        """Broadcast a batch of prefix-cache changes (stored/evicted hashes) to every frontend."""
        events = self._kv_events.drain(force) if self._kv_events is not None else None
        if events is not None:
            self.link.broadcast(Outputs([], stats, time.time(), events))  # type: ignore[union-attr]

    # ----------------------------------------------------------------------------- inputs

    def _on_input(self, item: ClientMessage | ClientGone | None) -> None:
        if item is None:  # a grammar compile finished: waking the loop was the point
            return
        if isinstance(item, ClientGone):
            ids = self._router.drop_client(item.identity)
            if ids:
                self.scheduler.abort_requests(ids)  # type: ignore[union-attr]
                log.info("aborted %d requests of gone client %d", len(ids), item.client_index)
            self.link.gone_handled(item.identity)  # type: ignore[union-attr]
            return
        msg = item.msg
        if isinstance(msg, AddRequest):
            self._add_request(item.identity, item.client_index, msg)
        elif isinstance(msg, Abort):
            eids = [eid for rid in msg.request_ids
                    if (eid := RequestRouter.engine_id(item.client_index, rid)) in self._router]
            if eids:
                self._publish(self.scheduler.abort_requests(eids))  # type: ignore[union-attr]
        elif isinstance(msg, UtilityCall):
            self.link.send(item.identity, self._utility(msg))  # type: ignore[union-attr]

    def _add_request(self, identity: bytes, client_index: int, msg: AddRequest) -> None:
        link = self.link
        assert link is not None
        if self._stop_reason is not None:
            link.send(identity, Error(ERR_ENGINE_SHUTDOWN, "engine-core is shutting down", msg.request_id))
            return
        eid = RequestRouter.engine_id(client_index, msg.request_id)
        if eid in self._router:
            link.send(identity, Error(ERR_DUPLICATE_ID, f"request id {msg.request_id!r} is already live",
                                      msg.request_id))
            return
        sched = self.scheduler
        assert sched is not None
        problem = check_timeout(msg.timeout_s)
        if problem is not None:
            link.send(identity, Error(ERR_INVALID_REQUEST, problem, msg.request_id))
            return
        refusal = self._admission.refusal(sched.requests.values(), len(sched.requests), len(msg.prompt_token_ids))
        if refusal is not None:
            link.send(identity, Error(ERR_OVERLOADED, refusal, msg.request_id))
            return
        try:
            request = Request(eid, msg.prompt_token_ids, msg.sampling_params, self.info.eos_token_ids,
                              arrival_time=msg.arrival_time or None, priority=msg.priority)
            sched.add_request(request)
        except ValueError as e:  # a check the IO thread does not know about: refuse this one request
            link.send(identity, Error(ERR_INVALID_REQUEST, str(e), msg.request_id))
            return
        self._router.add(eid, identity, msg.request_id)
        timeout_s = msg.timeout_s or self.cfg.request_timeout
        if timeout_s > 0:
            self._deadlines.add(request, time.monotonic(), timeout_s)

    def _expire(self, now: float) -> None:
        """Abort every live request past its deadline (blocks freed at once); tell its client why."""
        sched = self.scheduler
        assert sched is not None and self.link is not None
        for request, timeout_s in self._deadlines.pop_expired(now):
            eid = request.request_id
            if sched.requests.get(eid) is not request:
                continue  # finished (or a new request reusing its id)
            sched.abort_requests([eid])
            owner = self._router.pop(eid)
            if owner is not None:
                identity, client_id = owner
                self.link.send(identity, Error(
                    ERR_REQUEST_TIMEOUT, f"request {client_id!r} exceeded its deadline of {timeout_s:g} s "
                    f"({request.num_output_tokens} tokens generated) and was aborted", client_id))

    def _send_request_error(self, error: Error) -> None:
        route = self._router.pop(error.request_id)  # type: ignore[arg-type]
        if route is not None:
            identity, error.request_id = route
            self.link.send(identity, error)  # type: ignore[union-attr]

    def _utility(self, call: UtilityCall) -> UtilityResult:
        if call.method == "get_stats":
            return UtilityResult(call.call_id, True, self.stats())
        if call.method == "reset_prefix_cache":
            done = self.scheduler.reset_prefix_cache()  # type: ignore[union-attr]
            self._report_kv_events(self.stats(), force=True)
            return UtilityResult(call.call_id, True, done)
        return UtilityResult(call.call_id, False, None,
                             f"no utility method {call.method!r} "
                             f"(known: get_stats, reset_prefix_cache)")

    # ----------------------------------------------------------------------------- endings

    def _shutdown_gracefully(self, reason: str) -> None:
        """Abort every live request (finish reason "abort"), tell every client, then return."""
        self._take_inputs(block=False)  # late AddRequests get an engine_shutdown Error
        log.info("shutting down: %s; aborting %d live requests", reason, len(self._router))
        if len(self._router):
            self._publish(self.scheduler.abort_requests(self._router.live_ids()))  # type: ignore[union-attr]
        self.link.broadcast(Error(ERR_ENGINE_SHUTDOWN, f"engine-core is shutting down ({reason})",  # type: ignore[union-attr]
                                  fatal=True))

    def _fail_everyone(self, error: Error) -> None:
        """A fatal error: every client hears the root cause, then the engine exits."""
        if self.link is not None:
            self.link.broadcast(error)
        self._router.clear()
