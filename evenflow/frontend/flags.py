"""The HTTP frontend's flags, shared by ``evenflow-frontend`` and ``evenflow serve``."""

from __future__ import annotations

import argparse
import os

from evenflow.frontend.api.context import DEFAULT_MAX_BODY_BYTES
from evenflow.frontend.clients.engine_client import DEAD_AFTER_S
from evenflow.frontend.clients.router import ROUTING_POLICIES, RoutingConfig


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
    p.add_argument("--engine-timeout", type=_positive, default=DEAD_AFTER_S,
                   help="seconds of engine-core silence (of this process's running time: its own pauses do not "
                        "count) after which its requests fail; an engine-core that exits is noticed at once by "
                        "its closed connection")
    add_routing_flags(p)


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
