"""The OpenAI-compatible HTTP server: a lean Starlette app served by uvicorn on uvloop.

At start-up the app connects to the engine-core, loads the tokenizer from the folder the engine's
Ready names (or ``--tokenizer``), then serves. A background task refreshes engine stats, publishes
this frontend's metrics snapshot (for ``/metrics`` across N frontends) and logs a throughput line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from evenflow.frontend.choices import InvalidRequest
from evenflow.frontend.clients.router import RoutingConfig
from evenflow.frontend.engine_metrics import stats_log_line
from evenflow.frontend.metrics import FrontendMetrics
from evenflow.frontend.reuse_port import bind_reuseport
from evenflow.frontend.tokenizer import Tokenizer
from evenflow.frontend.api.chat import create_chat_completion
from evenflow.frontend.api.completions import create_completion
from evenflow.frontend.api.context import DEFAULT_MAX_BODY_BYTES, ServingContext, decode_body, read_body, request_timeout
from evenflow.frontend.api.errors import APIError, bad_request
from evenflow.frontend.api.http_guard import HttpLimits, guarded_protocol
from evenflow.frontend.clients.backpressure import DEFAULT_STUCK_READER_TIMEOUT_S
from evenflow.frontend.api.openai import DetokenizeRequest, DetokenizeResponse, ModelCard, ModelList, TokenizeRequest, TokenizeResponse, encode_json
from evenflow.frontend.api.prepare import CHARS_PER_TOKEN, chat_prompt_async, off_loop_if_large
from evenflow.frontend.api.sse import ClientDisconnected
from evenflow.frontend.api.lora_routes import LORA_ROUTES, lora_model_cards
from evenflow.frontend.lora_adapters import LoRAAdapters

logger = logging.getLogger("evenflow.frontend")

PUBLISH_INTERVAL_S = 1.0
LOG_INTERVAL_S = 10.0


@dataclass
class ServerConfig:
    """Frontend settings (the ``evenflow-frontend`` flags)."""

    engine_address: str = "tcp://127.0.0.1:7100"
    api_key: str | None = None
    served_model_name: str | None = None
    chat_template: str | None = None
    tokenizer: str | None = None
    metrics_dir: str | None = None
    log_stats: bool = True
    connect_timeout: float = 60.0
    frontend_name: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    curve_keys: str | None = None
    # Data parallel: every engine-core's address (more than one: requests are routed among them).
    engine_addresses: list[str] | None = None
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    allow_runtime_lora_updating: bool = False  # /v1/load_lora_adapter, /v1/unload_lora_adapter (API key needed)
    engine_timeout: float | None = None  # None: DEAD_AFTER_S (evenflow/frontend/clients/connection.py)
    http_limits: HttpLimits = field(default_factory=HttpLimits)
    stuck_reader_timeout: float = DEFAULT_STUCK_READER_TIMEOUT_S
    timeout_keep_alive: float = 5.0  # uvicorn's: an idle kept-alive connection is closed after this


def _json(obj: Any, status: int = 200) -> Response:
    return Response(encode_json(obj), status_code=status, media_type="application/json")


def _check_auth(ctx: ServingContext, request: Request) -> None:
    if not ctx.api_key:  # None or empty: no key configured
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), ctx.api_key.encode()):
        raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")


Handler = Callable[[ServingContext, Request], Awaitable[Any]]


def _endpoint(fn: Handler, auth: bool = True) -> Callable[[Request], Awaitable[Any]]:
    async def handle(request: Request) -> Any:
        ctx: ServingContext | None = getattr(request.app.state, "ctx", None)
        if ctx is None:
            return APIError(503, "the frontend is not connected to an engine yet").to_response()
        try:
            if auth:
                _check_auth(ctx, request)
            return await fn(ctx, request)
        except APIError as e:
            if e.rejected is not None:
                ctx.metrics.on_rejected(e.rejected)
            return e.to_response()
        except InvalidRequest as e:
            return bad_request(e.message, e.field).to_response()
        except ClientDisconnected:
            return Response(status_code=499)
        except Exception:
            logger.exception("unhandled error on %s", request.url.path)
            return APIError(500, "internal server error").to_response()

    return handle


async def _completions(ctx: ServingContext, request: Request) -> Any:
    return await create_completion(ctx, await read_body(request, ctx.max_body_bytes), request.receive,
                                   request_timeout(request.headers))


async def _chat(ctx: ServingContext, request: Request) -> Any:
    return await create_chat_completion(ctx, await read_body(request, ctx.max_body_bytes), request.receive,
                                        request_timeout(request.headers))


async def _models(ctx: ServingContext, request: Request) -> Response:
    cards = [ModelCard(name, ctx.created, ctx.max_model_len, root=ctx.model_root) for name in ctx.served_names]
    await ctx.lora.refresh(ctx.client)  # another frontend may have loaded or unloaded one
    cards += lora_model_cards(ctx)
    return _json(ModelList(cards))


async def _health(ctx: ServingContext, request: Request) -> Response:
    """At once, from what the client already knows: 200 while any engine-core behind this frontend
    serves (a long step or a paused worker is not ill health; a closed connection or a silence past
    --engine-timeout is), 503 with the cause otherwise. Asking the engine would wait on its step."""
    if ctx.client.connected:
        return Response(status_code=200)
    failure = getattr(ctx.client, "failure", None)
    cause = failure.message if failure is not None else "no engine-core is connected"
    return APIError(503, f"no engine-core can serve: {cause}",
                    headers={"Retry-After": "5"}).to_response()


async def _tokenize(ctx: ServingContext, request: Request) -> Response:
    req: TokenizeRequest = decode_body(await read_body(request, ctx.max_body_bytes), TokenizeRequest)
    ctx.check_model(req.model)
    if req.messages is not None:
        ids = await chat_prompt_async(req, ctx.tokenizer, req.messages)
    elif req.prompt is not None:
        ids = await off_loop_if_large(len(req.prompt), ctx.tokenizer.encode, req.prompt, req.add_special_tokens)
    else:
        raise bad_request("give either prompt or messages", "prompt")
    return _json(TokenizeResponse(ids, len(ids), ctx.max_model_len))


async def _detokenize(ctx: ServingContext, request: Request) -> Response:
    req: DetokenizeRequest = decode_body(await read_body(request, ctx.max_body_bytes), DetokenizeRequest)
    ctx.check_model(req.model)
    text = await off_loop_if_large(len(req.tokens) * CHARS_PER_TOKEN, _checked_decode, ctx.tokenizer, req.tokens)
    return _json(DetokenizeResponse(text))


def _checked_decode(tokenizer: Tokenizer, tokens: list[int]) -> str:
    bad = next((t for t in tokens if not 0 <= t < tokenizer.vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary [0, {tokenizer.vocab_size})", "tokens")
    return tokenizer.decode(tokens)


async def _refresh_engine_stats(ctx: ServingContext, timeout: float) -> None:
    with contextlib.suppress(Exception):
        result = await asyncio.wait_for(ctx.client.call_utility("get_stats"), timeout=timeout)
        if getattr(result, "ok", False) and result.result is not None and not isinstance(result.result, bool):
            per_engine = getattr(ctx.client, "engine_stats", None)  # data parallel: each engine-core's own
            ctx.metrics.set_engine_stats(result.result, per_engine=per_engine() if per_engine else None)
            return
    ctx.metrics.set_engine_stats(getattr(ctx.client, "stats", None))


async def _metrics(ctx: ServingContext, request: Request) -> Response:
    await _refresh_engine_stats(ctx, timeout=1.0)
    return Response(ctx.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def _background(ctx: ServingContext, log_stats: bool) -> None:
    """Every second: fresh engine stats, publish this frontend's snapshot; every 10 s: log line."""
    last_log, last_stats = time.monotonic(), None
    while True:
        await asyncio.sleep(PUBLISH_INTERVAL_S)
        await _refresh_engine_stats(ctx, timeout=PUBLISH_INTERVAL_S)
        with contextlib.suppress(OSError):
            ctx.metrics.write_snapshot()
        now = time.monotonic()
        if log_stats and now - last_log >= LOG_INTERVAL_S and ctx.metrics.engine is not None:
            line = stats_log_line(last_stats, ctx.metrics.engine, now - last_log)
            if line:
                logger.info(line)
            last_log, last_stats = now, ctx.metrics.engine


async def connect_context(config: ServerConfig, client: Any = None) -> ServingContext:
    """Connect to the engine-core, load the tokenizer, and make the handlers' context."""
    if client is None:
        client = _engine_client(config)
    ready = await client.connect(timeout=config.connect_timeout)
    tokenizer = Tokenizer.from_dir(config.tokenizer or ready.model_path, chat_template=config.chat_template)
    name = config.served_model_name or ready.model_name
    aliases = () if config.served_model_name else tuple(ready.model_aliases)
    metrics = FrontendMetrics(metrics_model_label(name), config.metrics_dir or os.environ.get("EVENFLOW_METRICS_DIR"),
                              config.frontend_name)
    return ServingContext(client, tokenizer, name, ready.max_model_len, ready.vocab_size, metrics,
                          api_key=config.api_key, model_root=ready.model_path, model_aliases=aliases,
                          max_body_bytes=config.max_body_bytes, lora=LoRAAdapters.from_ready(ready))


def metrics_model_label(served_name: str) -> str:
    """The ``model_name`` label of /metrics: a served name that is a filesystem path (the default,
    vLLM's rule: the --model string) shows only its last part, so scrapes do not reveal the layout."""
    if not served_name.startswith(("/", "./", "../", "~")):  # a name, or a hub id such as org/model
        return served_name
    return os.path.basename(served_name.rstrip("/")) or served_name


def _engine_client(config: ServerConfig) -> Any:
    """One engine-core: an EngineClient; several: a DataParallelClient routing among them."""
    name = config.frontend_name or f"frontend-{os.getpid()}"
    addresses = config.engine_addresses or [config.engine_address]
    if len(addresses) > 1:
        from evenflow.frontend.clients.data_parallel import DataParallelClient

        return DataParallelClient(addresses, name, config.routing, curve_keys=config.curve_keys,
                                  engine_timeout=config.engine_timeout, stuck_reader_timeout=config.stuck_reader_timeout)
    from evenflow.frontend.clients.engine_client import EngineClient

    return EngineClient(addresses[0], client_name=name, curve_keys=config.curve_keys,
                        engine_timeout=config.engine_timeout, stuck_reader_timeout=config.stuck_reader_timeout)


def build_app(config: ServerConfig, context: Callable[[], Awaitable[ServingContext]] | None = None) -> Starlette:
    """The ASGI app. ``context`` makes the handlers' context at start-up (default: connect to
    ``config.engine_address``); the CLI connects before opening its port and passes it in."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        ctx = await (context() if context is not None else connect_context(config))
        app.state.ctx = ctx
        task = asyncio.ensure_future(_background(ctx, config.log_stats))
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            with contextlib.suppress(OSError):
                ctx.metrics.write_snapshot()
            await ctx.client.close()

    routes = [
        Route("/v1/completions", _endpoint(_completions), methods=["POST"]),
        Route("/v1/chat/completions", _endpoint(_chat), methods=["POST"]),
        Route("/v1/models", _endpoint(_models), methods=["GET"]),
        Route("/tokenize", _endpoint(_tokenize), methods=["POST"]),
        Route("/detokenize", _endpoint(_detokenize), methods=["POST"]),
        Route("/health", _endpoint(_health, auth=False), methods=["GET"]),
        Route("/metrics", _endpoint(_metrics, auth=False), methods=["GET"]),
    ]
    if config.allow_runtime_lora_updating:  # as vLLM: the routes exist only when asked for
        if not config.api_key:
            raise ValueError("--allow-runtime-lora-updating needs --api-key: anyone who can reach the port "
                             "could otherwise load files from this host as adapters")
        routes += [Route(path, _endpoint(handler), methods=["POST"]) for path, handler in LORA_ROUTES]
    return Starlette(routes=routes, lifespan=lifespan)


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket with SO_REUSEPORT, so N frontend processes share one port."""
    sock = bind_reuseport(host, port)
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


async def serve_app(app: Starlette, sock: socket.socket, config: ServerConfig | None = None) -> None:
    """Serve ``app`` with uvicorn on the current (uvloop) event loop until SIGINT/SIGTERM."""
    import uvicorn

    config = config or ServerConfig()
    limits = config.http_limits
    # h11's own limit (a 400) sits above ours, so an oversized head gets http_guard's 431.
    cfg = uvicorn.Config(app, loop="none", log_level="warning", access_log=False, timeout_graceful_shutdown=5,
                         lifespan="on", http=guarded_protocol(limits),  # type: ignore[arg-type]
                         h11_max_incomplete_event_size=2 * limits.max_head_bytes + 65536,
                         timeout_keep_alive=int(config.timeout_keep_alive))
    await uvicorn.Server(cfg).serve(sockets=[sock])
