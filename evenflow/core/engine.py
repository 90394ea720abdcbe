"""EngineCore: the frontend side of the engine around its step loop (engine_loop.py).

It owns what the loop does not: the FrontendLink (sockets and msgpack live on its threads; this
object only moves Structs), the routing of outputs to the clients that asked, per-request
deadlines and admission limits, utility calls, and the endings (graceful shutdown, fatal errors).
``run()`` alternates: take the inputs that arrived, expire deadlines, run one loop step, publish.
"""

from __future__ import annotations

import logging
import queue
import time
import uuid

import zmq

from evenflow.protocol import (
    ERR_DUPLICATE_ID, ERR_ENGINE_SHUTDOWN, ERR_INVALID_REQUEST, ERR_OVERLOADED, ERR_REQUEST_TIMEOUT, ERR_WORKER_DIED,
    PROTOCOL_VERSION, Abort, AddRequest, Error, Hold, Outputs, Ready, RequestOutput, SchedulerStats, UtilityCall,
    UtilityResult,
)
from evenflow.protocol.executor import Executor
from evenflow.protocol.gguf_tokenizer import tokenizer_json_source

from evenflow.core.admission import AdmissionLimits
from evenflow.core.component_configs import scheduler_config, worker_template
from evenflow.core.deadlines import Deadlines, check_timeout
from evenflow.core.engine_config import EngineConfig
from evenflow.core.engine_loop import EngineLoop
from evenflow.core.frontend_link import ClientGone, ClientMessage, FrontendLink
from evenflow.core.kv.events import KVEventLog
from evenflow.core.lora_calls import LORA_METHODS, lora_of_request, lora_registry_for, lora_utility
from evenflow.core.model_info import ModelInfo
from evenflow.core.multi_node import NodeLayout
from evenflow.core.request import Request
from evenflow.core.routing import RequestRouter
from evenflow.core.sched.scheduler import Scheduler
from evenflow.core.sched.structured_output import StructuredOutputManager
from evenflow.core.step_watchdog import StepTimeout, StepWatchdog
from evenflow.core.workers import WorkerFailure, WorkerGroup

log = logging.getLogger("evenflow.core.engine")

ERR_INTERNAL = "internal_error"  # a bug in the engine-core itself (listed in evenflow/protocol/README.md)
_IDLE_WAKEUP_S = 0.25  # how often an idle loop checks workers and the stop flag


class EngineCore:
    """One engine-core: its step loop (scheduler + executor) and the frontend ROUTER.

    ``executor``: what runs the model; by default the worker processes (``WorkerGroup``), or any
    other ``Executor`` such as evenflow/worker/in_process.py's. ``run()`` returns an exit code.
    """

    def __init__(self, cfg: EngineConfig, info: ModelInfo, executor: Executor | None = None) -> None:
        self.cfg = cfg
        self.info = info
        self.max_model_len = cfg.max_model_len or info.max_model_len
        self._ctx = zmq.Context()
        self._stop_reason: str | None = None
        self._router = RequestRouter()
        self._admission = AdmissionLimits(cfg.max_num_queued_reqs, cfg.max_num_queued_tokens)
        self._deadlines = Deadlines()
        if executor is None:
            layout = NodeLayout.from_config(cfg) if cfg.nnodes > 1 else None  # ranks on several hosts
            executor = WorkerGroup(self._ctx, worker_template(cfg, info.model_path, self.max_model_len),
                                   cfg.worker_start_timeout, layout=layout)
        self.executor = executor
        self._loop: EngineLoop | None = None
        self._link: FrontendLink | None = None
        self._kv_events: KVEventLog | None = None  # prefix-cache changes for routing frontends
        self.lora = lora_registry_for(cfg)  # None: LoRA off

    @property
    def loop(self) -> EngineLoop:
        if self._loop is None:
            raise RuntimeError("call start() first")
        return self._loop

    @property
    def scheduler(self) -> Scheduler:
        return self.loop.scheduler

    @property
    def link(self) -> FrontendLink:
        if self._link is None:
            raise RuntimeError("call start() first")
        return self._link

    # ----------------------------------------------------------------------------- start-up

    def start(self) -> Ready:
        """Start workers, size the KV cache (min over ranks), build the scheduler, bind the ROUTER."""
        readies = self.executor.start()
        block_sizes = {r.block_size for r in readies}
        if len(block_sizes) != 1:
            raise ValueError(f"workers disagree on the block size: {sorted(block_sizes)}")
        # The attention backend may round the requested block size; the workers' value is the truth.
        self.block_size = block_sizes.pop()
        num_blocks = min(r.num_kv_blocks for r in readies)
        if self.cfg.num_kv_blocks is not None:
            num_blocks = min(num_blocks, self.cfg.num_kv_blocks)
        sched_cfg = scheduler_config(self.cfg, num_blocks, self.block_size, self.max_model_len)
        sched_cfg.validate()
        self.executor.init_kv_cache(num_blocks)
        # A finished grammar compile wakes an idle loop through the inbox (None: no message).
        grammars = StructuredOutputManager(tokenizer_json_source(self.info.model_path), self.info.vocab_size,
                                           self.info.eos_token_ids, wake=lambda: self.link.inbox.put(None))
        grammars.prepare()
        scheduler = Scheduler(sched_cfg, grammars)
        if isinstance(self.executor, WorkerGroup):  # the in-process executor runs in the caller's own time
            controller = scheduler.budget_controller
            self.executor.watchdog = StepWatchdog(self.cfg.step_timeout,
                                                  None if controller is None else controller.predicted_s)
        if self.cfg.enable_prefix_caching:
            self._kv_events = scheduler.kv_cache_manager.pool.events = KVEventLog()
        self._loop = EngineLoop(scheduler, self.executor, self.cfg.async_scheduling)
        ready = Ready(PROTOCOL_VERSION, self.info.model_name, self.info.model_path, self.max_model_len,
                      self.info.vocab_size, list(self.info.eos_token_ids), self.block_size, num_blocks,
                      self.cfg.max_num_batched_tokens, uuid.uuid4().hex[:12], self.cfg.max_frame_bytes,
                      list(self.info.model_aliases), None if self.lora is None else self.lora.refs())
        self._link = FrontendLink(self._ctx, self.cfg.listen, ready, max_frame_bytes=self.cfg.max_frame_bytes,
                                  client_timeout=self.cfg.client_timeout, curve_keys=self.cfg.curve_keys)
        self._link.start()
        log.info("workers ready: %s; %d KV blocks of %d tokens", readies, num_blocks, self.block_size)
        return ready

    def request_stop(self, reason: str) -> None:
        """Ask the loop to shut down gracefully (safe from a signal handler: sets one attribute)."""
        self._stop_reason = reason

    # ----------------------------------------------------------------------------- the loop

    def run(self) -> int:
        """Serve until stopped (exit 0) or until a worker fails (exit 1)."""
        loop, link = self.loop, self.link
        try:
            progressed = True
            while self._stop_reason is None:
                # Block on the inbox when there is nothing to do, or when the scheduler has requests
                # it cannot run yet (e.g. too big for free blocks): only an input can change that.
                busy = bool(loop.num_in_flight) or (progressed and loop.scheduler.has_unfinished_requests())
                self._take_inputs(block=not busy)
                if self._deadlines:
                    self._expire(time.monotonic())
                progressed = self._step()
            self._shutdown_gracefully(self._stop_reason)
            return 0
        except (WorkerFailure, StepTimeout) as e:
            log.error("%s", e)
            self._fail_everyone(Error(ERR_WORKER_DIED, str(e), fatal=True))
            return 1
        except Exception as e:
            log.exception("engine-core failed")
            self._fail_everyone(Error(ERR_INTERNAL, f"engine-core failed: {type(e).__name__}: {e}",
                                      fatal=True))
            return 1
        finally:
            link.close()
            if loop.scheduler.structured_output is not None:
                loop.scheduler.structured_output.shutdown()
            self.executor.shutdown(timeout=1.0 if self._stop_reason is None else 5.0)
            self._ctx.destroy(linger=0)

    def _take_inputs(self, block: bool) -> None:
        inbox = self.link.inbox
        if block:
            try:
                self._on_input(inbox.get(timeout=_IDLE_WAKEUP_S))
            except queue.Empty:
                self.executor.check_alive()
                return
        while True:
            try:
                self._on_input(inbox.get_nowait())
            except queue.Empty:
                return

    def _step(self) -> bool:
        """One step of the loop; publish what it finished. Returns whether anything moved."""
        step = self.loop.step()
        for error in self.scheduler.take_grammar_failures():  # the request is gone: tell its client why
            self._send_request_error(error)
        if step.outputs is not None:
            self._publish(step.outputs)
        return step.progressed

    def stats(self) -> SchedulerStats:
        """The scheduler's stats with the engine-measured timing split filled in."""
        return self.loop.stats()

    def _publish(self, outputs: list[RequestOutput]) -> None:
        """Route outputs to the clients that asked (one Outputs per client), with fresh stats."""
        stats = self.stats()
        link = self.link
        link.set_stats(stats)
        now = time.time()
        for identity, outs in self._router.route(outputs).items():
            link.send(identity, Outputs(outs, stats, now))
        self._report_kv_events(stats, force=not self.scheduler.has_unfinished_requests())

    def _report_kv_events(self, stats: SchedulerStats, force: bool) -> None:
        """Broadcast a batch of prefix-cache changes (stored/evicted hashes) to every frontend."""
        events = self._kv_events.drain(force) if self._kv_events is not None else None
        if events is not None:
            self.link.broadcast(Outputs([], stats, time.time(), events))

    # ----------------------------------------------------------------------------- inputs

    def _on_input(self, item: ClientMessage | ClientGone | None) -> None:
        if item is None:  # a grammar compile finished: waking the loop was the point
            return
        if isinstance(item, ClientGone):
            ids = self._router.drop_client(item.identity)
            if ids:
                self.scheduler.abort_requests(ids)
                log.info("aborted %d requests of gone client %d", len(ids), item.client_index)
            self.link.gone_handled(item.identity)
            return
        msg = item.msg
        if isinstance(msg, AddRequest):
            self._add_request(item.identity, item.client_index, msg)
        elif isinstance(msg, Hold):
            self.scheduler.hold_requests(
                (RequestRouter.engine_id(item.client_index, rid) for rid in msg.request_ids), msg.hold)
        elif isinstance(msg, Abort):
            eids = [eid for rid in msg.request_ids
                    if (eid := RequestRouter.engine_id(item.client_index, rid)) in self._router]
            if eids:
                self._publish(self.scheduler.abort_requests(eids))
        elif isinstance(msg, UtilityCall):
            self.link.send(item.identity, self._utility(msg))

    def _add_request(self, identity: bytes, client_index: int, msg: AddRequest) -> None:
        link = self.link
        if self._stop_reason is not None:
            link.send(identity, Error(ERR_ENGINE_SHUTDOWN, "engine-core is shutting down", msg.request_id))
            return
        eid = RequestRouter.engine_id(client_index, msg.request_id)
        if eid in self._router:
            link.send(identity, Error(ERR_DUPLICATE_ID, f"request id {msg.request_id!r} is already live",
                                      msg.request_id))
            return
        sched = self.scheduler
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
            if msg.lora_name:
                adapter = lora_of_request(self.lora, msg.lora_name)
                if isinstance(adapter, Error):
                    adapter.request_id = msg.request_id
                    link.send(identity, adapter)
                    return
                request.set_lora(adapter)
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
        route = self._router.pop(error.request_id) if error.request_id is not None else None
        if route is not None:
            identity, error.request_id = route
            self.link.send(identity, error)

    def _utility(self, call: UtilityCall) -> UtilityResult:
        if call.method == "get_stats":
            return UtilityResult(call.call_id, True, self.stats())
        if call.method in LORA_METHODS:
            return lora_utility(call, self.lora, self.scheduler)
        if call.method == "reset_prefix_cache":
            done = self.scheduler.reset_prefix_cache()
            self._report_kv_events(self.stats(), force=True)
            return UtilityResult(call.call_id, True, done)
        return UtilityResult(call.call_id, False, None,
                             f"no utility method {call.method!r} "
                             f"(known: get_stats, reset_prefix_cache, {', '.join(LORA_METHODS)})")

    # ----------------------------------------------------------------------------- endings

    def _shutdown_gracefully(self, reason: str) -> None:
        """Abort every live request (finish reason "abort"), tell every client, then return."""
        self._take_inputs(block=False)  # late AddRequests get an engine_shutdown Error
        log.info("shutting down: %s; aborting %d live requests", reason, len(self._router))
        if len(self._router):
            self._publish(self.scheduler.abort_requests(self._router.live_ids()))
        self.link.broadcast(Error(ERR_ENGINE_SHUTDOWN, f"engine-core is shutting down ({reason})",
                                  fatal=True))

    def _fail_everyone(self, error: Error) -> None:
        """A fatal error: every client hears the root cause, then the engine exits."""
        if self._link is not None:
            self._link.broadcast(error)
        self._router.clear()
