"""DataParallelClient: one frontend's connections to several engine-cores (data parallel).

Each engine-core is an ordinary EngineClient (handshake, heartbeats, reconnection); this class
routes every request to one of them (dp_router.py), remembers which one so aborts reach it, and
presents the same interface as EngineClient, so the HTTP server does not know how many engines
there are. An engine-core that dies fails only its own requests (EngineClient raises the cause);
while it is unreachable new requests go to the others, and once its EngineClient has said Hello
again to the restarted engine it takes requests again, with an empty prefix index.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import AsyncIterator, TypeVar

from msgspec import Struct

from evenflow.protocol import (
    ERR_DUPLICATE_ID, Outputs, Ready, RequestOutput, SamplingParams, SchedulerStats, UtilityResult, LoRALoad,
)
from evenflow.protocol.block_hash import adapter_extra_keys, extend_block_hashes
from evenflow.protocol.lora import AdapterRef

from evenflow.frontend.clients.backpressure import DEFAULT_STUCK_READER_TIMEOUT_S
from evenflow.frontend.clients.engine_client import EngineClient
from evenflow.frontend.clients.errors import ERR_ENGINE_DEAD, ERR_NOT_CONNECTED, EngineError
from evenflow.frontend.clients.router import Decision, Router, RoutingConfig

log = logging.getLogger("evenflow.frontend.clients.data_parallel")

S = TypeVar("S", bound=Struct)

# Ready fields every engine-core behind one frontend must agree on (the frontend serves one model).
_SAME_MODEL = ("model_name", "model_path", "max_model_len", "vocab_size", "eos_token_ids", "block_size")


def route_hashes(prompt_token_ids: list[int], block_size: int, lora: AdapterRef | None) -> list[bytes]:
    """The block hashes a prompt will have in an engine-core (its adapter's identity included)."""
    hashes: list[bytes] = []
    # As the engine: full blocks only, and never the last token (it is always recomputed).
    extend_block_hashes(hashes, prompt_token_ids, (len(prompt_token_ids) - 1) // block_size, block_size,
                        adapter_extra_keys(lora.identity if lora is not None else None))
    return hashes


def sum_stats(snapshots: list[SchedulerStats]) -> SchedulerStats:
    """Totals over engine-cores: counts and seconds add up; KV cache usage is the mean; the
    adaptive budget's target is the engines' (the same flag), not a sum."""
    total = _add_structs(SchedulerStats, snapshots)
    total.kv_cache.usage = total.kv_cache.usage / max(1, len(snapshots))
    total.budget.target_itl_s = max((s.budget.target_itl_s for s in snapshots), default=0.0)
    return total


def _add_structs(cls: type[S], items: list[S]) -> S:
    """Field by field sums of structs of one type (an empty list: the defaults)."""
    if not items:
        return cls()
    return cls(*(_add([getattr(item, name) for item in items]) for name in cls.__struct_fields__))


def _add(values: list) -> object:
    """A sum; owners' parts add field by field, and per-bucket counts (``grammar.compile_buckets``,
    ``budget.token_budget_log2_counts``) bucket by bucket."""
    if isinstance(values[0], Struct):
        return _add_structs(type(values[0]), values)
    if isinstance(values[0], list):
        return [sum(column) for column in itertools.zip_longest(*values, fillvalue=0)]
    return sum(values)


class DataParallelClient:
    """Async client of N engine-cores serving the same model; duck-types EngineClient."""

    def __init__(self, addresses: list[str], client_name: str = "", routing: RoutingConfig | None = None,
                 curve_keys: str | None = None, engine_timeout: float | None = None,
                 stuck_reader_timeout: float = DEFAULT_STUCK_READER_TIMEOUT_S) -> None:
        if len(addresses) < 1 or len(set(addresses)) != len(addresses):
            raise ValueError(f"give each engine-core address once, got {addresses}")
        self.addresses = list(addresses)
        self.routing = routing or RoutingConfig()
        self.routing.validate()
        self.clients = [EngineClient(a, client_name, curve_keys=curve_keys, engine_timeout=engine_timeout,
                                     stuck_reader_timeout=stuck_reader_timeout) for a in addresses]
        self.router: Router | None = None
        self._owner: dict[str, int] = {}  # live request id -> engine index
        self._engine_ids: list[str] = []  # each engine's id at its latest Ready (a change = a restart)
        self._stats: list[SchedulerStats | None] = [None] * len(addresses)
        self.decisions: dict[str, int] = {}  # routing reason -> requests (for tests and the benchmark)
        self.resent = 0  # requests sent again after their engine-core died before their first output

    # ----------------------------------------------------------------------------- EngineClient's face

    @property
    def ready(self) -> Ready | None:
        return self.clients[0].ready

    @property
    def connected(self) -> bool:
        return any(c.connected for c in self.clients)

    @property
    def failure(self) -> EngineError | None:
        """Why no engine-core can serve; None while any one does."""
        return None if self.connected else self._unreachable()

    @property
    def stats(self) -> SchedulerStats | None:
        known = [s for s in self._stats if s is not None]
        return sum_stats(known) if known else None

    def engine_stats(self) -> dict[str, SchedulerStats]:
        """Latest stats per engine-core, labelled by its position in ``--engine`` ("0", "1", ...)."""
        return {str(i): s for i, s in enumerate(self._stats) if s is not None}

    async def connect(self, timeout: float = 30.0) -> Ready:
        """Connect to every engine-core (all must answer, and serve the same model)."""
        results = await asyncio.gather(*(c.connect(timeout) for c in self.clients), return_exceptions=True)
        failed = [(a, r) for a, r in zip(self.addresses, results) if isinstance(r, BaseException)]
        if failed:
            await self.close()
            raise EngineError(ERR_NOT_CONNECTED, "; ".join(f"{a}: {r}" for a, r in failed))
        readies: list[Ready] = results  # type: ignore[assignment]
        for name in _SAME_MODEL:
            values = [getattr(r, name) for r in readies]
            if any(v != values[0] for v in values):
                await self.close()
                raise EngineError(ERR_NOT_CONNECTED, f"the engine-cores disagree on {name}: "
                                  + ", ".join(f"{a}: {v!r}" for a, v in zip(self.addresses, values)))
        self.router = Router.for_engines(self.routing, [r.num_kv_blocks for r in readies])
        self._engine_ids = [r.engine_id for r in readies]
        for i, client in enumerate(self.clients):
            client.on_outputs = lambda msg, i=i: self._on_outputs(i, msg)
        log.info("connected to %d engine-cores (routing: %s)", len(readies), self.routing.policy)
        return readies[0]

    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                       priority: int = 0, arrival_time: float | None = None,
                       timeout_s: float = 0.0, lora: AdapterRef | None = None) -> AsyncIterator[RequestOutput]:
        """Route the request to one engine-core and stream its deltas (see EngineClient.generate).

        If that engine-core dies before the request's first output, the request is sent once more,
        with the same id, to another one that serves: the client sees a slower success."""
        if request_id in self._owner:
            raise EngineError(ERR_DUPLICATE_ID, f"request id {request_id!r} is already live", request_id)
        deadline: dict = {"timeout_s": timeout_s} if timeout_s > 0 else {}
        if lora is not None:
            deadline["lora"] = lora
        excluded: set[int] = set()
        while True:
            engine = self._route_request(request_id, prompt_token_ids, excluded, lora)
            inner = self.clients[engine].generate(request_id, prompt_token_ids, sampling_params, priority,
                                                  arrival_time, **deadline)
            got_output = False
            try:
                async for out in inner:
                    got_output = True
                    yield out
                return
            except EngineError as e:
                others = [i for i, c in enumerate(self.clients) if c.connected and i != engine]
                if e.code != ERR_ENGINE_DEAD or got_output or excluded or not others:
                    raise
                log.warning("engine-core %d died before request %s had output: sending it to another (%s)",
                            engine, request_id, e.message)
                excluded.add(engine)
                self.resent += 1
            finally:
                self._owner.pop(request_id, None)
                await inner.aclose()  # an early stop aborts the request in its engine-core

    def _route_request(self, request_id: str, prompt_token_ids: list[int], excluded: set[int],
                       lora: AdapterRef | None = None) -> int:
        decision, hashes = self._route(prompt_token_ids, excluded, lora)
        assert self.router is not None
        self.router.on_routed(decision.engine, hashes)
        self.decisions[decision.reason] = self.decisions.get(decision.reason, 0) + 1
        self._owner[request_id] = decision.engine
        return decision.engine

    async def abort(self, request_ids: list[str]) -> None:
        by_engine: dict[int, list[str]] = {}
        for rid in request_ids:
            engine = self._owner.get(rid)
            if engine is not None:
                by_engine.setdefault(engine, []).append(rid)
        for engine, ids in by_engine.items():
            await self.clients[engine].abort(ids)

    async def call_utility(self, method: str, timeout: float = 30.0, lora: LoRALoad | None = None) -> UtilityResult:
        """Call ``method`` on every reachable engine-core. ``get_stats`` returns the totals (and
        refreshes ``engine_stats()``); it succeeds while at least one engine answers."""
        live = [i for i, c in enumerate(self.clients) if c.connected]
        if not live:
            raise self._unreachable()
        extra = {"lora": lora} if lora is not None else {}
        results = await asyncio.gather(*(self.clients[i].call_utility(method, timeout, **extra) for i in live),
                                       return_exceptions=True)
        answers = {i: r for i, r in zip(live, results) if isinstance(r, UtilityResult)}
        if not answers:
            raise next(r for r in results if isinstance(r, BaseException))
        if method == "get_stats":
            for i, r in answers.items():
                if isinstance(r.result, SchedulerStats):
                    self._stats[i] = r.result
            return UtilityResult(0, True, self.stats)
        ok = all(r.ok for r in answers.values()) and len(answers) == len(self.clients)
        return UtilityResult(0, ok, ok, "" if ok else f"{len(self.clients) - len(answers)} engine-core(s) "
                                                      "did not answer", next(iter(answers.values())).lora_adapters)

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients), return_exceptions=True)

    # ----------------------------------------------------------------------------- internals

    def _route(self, prompt_token_ids: list[int], excluded: set[int] | frozenset[int] = frozenset(),
               lora: AdapterRef | None = None) -> tuple[Decision, list[bytes]]:
        assert self.router is not None and self.ready is not None, "call connect() first"
        # A client that noticed its engine's death (a closed connection) is not connected: it leaves
        # routing at once, and comes back when its engine-core answers Ready again.
        candidates = [i for i, c in enumerate(self.clients) if c.connected and i not in excluded]
        if not candidates:
            raise self._unreachable()
        for i in candidates:
            self._notice_restart(i)
        hashes = route_hashes(prompt_token_ids, self.ready.block_size, lora) if self.routing.policy == "prefix" else []
        return self.router.choose(hashes, candidates), hashes

    def _notice_restart(self, engine: int) -> None:
        ready = self.clients[engine].ready
        if ready is not None and ready.engine_id != self._engine_ids[engine]:
            log.info("engine-core %d (%s) restarted: routing to it again", engine, self.addresses[engine])
            self._engine_ids[engine] = ready.engine_id
            self.router.on_engine_restart(engine)  # type: ignore[union-attr]

    def _on_outputs(self, engine: int, msg: Outputs) -> None:
        assert self.router is not None
        self._notice_restart(engine)
        if msg.stats is not None:
            self._stats[engine] = msg.stats
            self.router.on_stats(engine, msg.stats)
        if msg.kv_events is not None:
            self.router.on_kv_events(engine, msg.kv_events)

    def _unreachable(self) -> EngineError:
        causes = "; ".join(f"{a}: {c.failure.message if c.failure else 'not connected'}"
                           for a, c in zip(self.addresses, self.clients))
        return EngineError(ERR_ENGINE_DEAD, f"no engine-core is reachable ({causes})")
