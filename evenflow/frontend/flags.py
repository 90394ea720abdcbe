"""The HTTP frontend's flags, shared by ``evenflow-frontend`` and ``evenflow serve``."""

from __future__ import annotations

import argparse
import os

from evenflow.frontend.api.context import DEFAULT_MAX_BODY_BYTES
from evenflow.frontend.api.http_guard import HttpLimits
from evenflow.frontend.clients.backpressure import DEFAULT_STUCK_READER_TIMEOUT_S
from evenflow.frontend.clients.connection import DEAD_AFTER_S
from evenflow.frontend.clients.router import ROUTING_POLICIES, RoutingConfig

RUNTIME_LORA_ENV = "EVENFLOW_ALLOW_RUNTIME_LORA_UPDATING"


def add_frontend_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="HTTP address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument("--api-key", default=os.environ.get("EVENFLOW_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every path but /health and /metrics "
                        "(default: $EVENFLOW_API_KEY; prefer the variable: flags show in `ps`)")
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="larger HTTP bodies are refused with 413 before being read whole")
    p.add_argument("--served-model-name", default=None, help="model name in the API (default: the engine's)")
    p.add_argument("--chat-template", default=None, help="jinja2 chat template file (overrides the model's)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the engine's model folder)")
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   default=os.environ.get(RUNTIME_LORA_ENV, "").lower() in ("1", "true"),
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
                        f"VLLM_ALLOW_RUNTIME_LORA_UPDATING; default: ${RUNTIME_LORA_ENV}); needs --api-key")
    p.add_argument("--engine-timeout", type=_positive, default=DEAD_AFTER_S,
                   help="seconds of engine-core silence (of this process's running time: its own pauses do not "
                        "count) after which its requests fail; an engine-core that exits is noticed at once by "
                        "its closed connection")
    p.add_argument("--stuck-reader-timeout", type=_positive, default=DEFAULT_STUCK_READER_TIMEOUT_S,
                   help="seconds a request may stay held because its client reads none of its output (the engine "
                        "generates nothing for it meanwhile) before it is aborted and its KV cache freed")
    add_http_limit_flags(p)
    add_routing_flags(p)


def add_http_limit_flags(p: argparse.ArgumentParser) -> None:
    """Connection hygiene (evenflow/frontend/api/http_guard.py)."""
    d = HttpLimits()
    p.add_argument("--header-timeout", type=_positive, default=d.header_timeout_s,
                   help="seconds a client has to send a request's head (and each chunk of its body); else 408 "
                        "and the connection is closed (slowloris, silent sockets)")
    p.add_argument("--timeout-keep-alive", type=_positive, default=5.0,
                   help="seconds an idle kept-alive connection stays open between requests")
    p.add_argument("--h11-max-incomplete-event-size", type=int, default=d.max_head_bytes,
                   help="largest request head (request line + headers) in bytes; larger: 431")
    p.add_argument("--h11-max-header-count", type=int, default=d.max_header_count,
                   help="most headers in one request; more: 431")
    p.add_argument("--max-connections", type=int, default=d.max_connections,
                   help="most open HTTP connections of this frontend (capped below its file-descriptor "
                        "limit); one more is answered 503 and closed, with a log line")


def http_limits(args: argparse.Namespace) -> HttpLimits:
    return HttpLimits(args.header_timeout, args.h11_max_incomplete_event_size, args.h11_max_header_count,
                      args.max_connections)


def add_routing_flags(p: argparse.ArgumentParser) -> None:
    """How a frontend attached to several engine-cores (data parallel) picks one per request."""
    d = RoutingConfig()
    p.add_argument("--routing-policy", choices=ROUTING_POLICIES, default=d.policy,
                   help="with several engine-cores: prefix (cache-aware, with a hot-spot guard), load "
                        "(4*waiting + running), or round_robin")
    p.add_argument("--routing-balance-abs-threshold", type=float, default=d.balance_abs_threshold,
                   help="prefix routing turns to load balancing when the busiest engine's load score exceeds "
                        "the idlest's by more than this ...")
    p.add_argument("--routing-balance-rel-threshold", type=float, default=d.balance_rel_threshold,
                   help="... and is more than this many times it")


def routing_config(args: argparse.Namespace) -> RoutingConfig:
    return RoutingConfig(args.routing_policy, args.routing_balance_abs_threshold, args.routing_balance_rel_threshold)


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value
