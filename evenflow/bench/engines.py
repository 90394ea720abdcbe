"""The engines ``bench_peer.py`` compares on one model, and how each is launched.

- ``evenflow`` / ``vllm``: the HF folder ``--model-dir`` in ``--dtype`` (the two-engine comparison).
- ``evenflow-f32``, ``evenflow-bf16``: evenflow on the GGUF file (``--gguf``) dequantized to that
  dtype (``--quantization none``); ``evenflow-int4``: evenflow on the GGUF with its default flags
  (``--dtype auto``: the Q4 projections through the int4 kernel where the start-up plan finds it
  faster); ``evenflow-int4-auto``: the same with the derived target (``--target-itl-ms auto``, the
  budget its ceiling), the default issue 27 weighs.
- ``vllm``: vLLM's CPU build on the HF folder made from the same GGUF (``--vllm-dtype``).
- ``llama.cpp``: ``llama-server`` (``--llama-server``) on the very same GGUF: one slot per stream
  that can be in flight, one KV buffer shared by all slots holding as many tokens as the other
  engines' caches, its batch (``-b``/``-ub``) set to the token budget.

Every engine gets the same max_model_len, budget, KV size (in tokens) and max_num_seqs.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import shutil
from pathlib import Path

from evenflow.bench.launch import kv_bytes_per_token, model_config, server_spec
from evenflow.bench.server import ServerConfig, ServerSpec, free_port, template_argv

GGUF_EVENFLOW = {"evenflow-f32": ["--dtype", "float32", "--quantization", "none"],
                 "evenflow-bf16": ["--dtype", "bfloat16", "--quantization", "none"],
                 "evenflow-int4": ["--dtype", "auto"],
                 "evenflow-int4-auto": ["--dtype", "auto", "--target-itl-ms", "auto"]}
ENGINES = ("evenflow", "vllm", *GGUF_EVENFLOW, "llama.cpp")
DEFAULT_LLAMA_SERVER = Path("/work/peers/llama/build/bin/llama-server")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engines")
    g.add_argument("--engines", default="evenflow,vllm", help=f"comma list of {', '.join(ENGINES)}")
    g.add_argument("--gguf", type=Path, default=None, help="the GGUF file evenflow-* and llama.cpp serve")
    g.add_argument("--vllm-dtype", default=None, help="vLLM's --dtype (default: --dtype)")
    g.add_argument("--llama-server", type=Path, default=DEFAULT_LLAMA_SERVER, help="llama.cpp's llama-server binary")
    g.add_argument("--threads", type=int, default=2, help="llama.cpp's -t (evenflow and vLLM use every core)")


def parse_engines(args: argparse.Namespace) -> list[str]:
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        raise SystemExit(f"unknown engine(s) {', '.join(unknown)} (known: {', '.join(ENGINES)})")
    if args.gguf is None and any(e in GGUF_EVENFLOW or e == "llama.cpp" for e in engines):
        raise SystemExit("--gguf FILE is needed for evenflow-f32/-bf16/-int4 and llama.cpp")
    return engines


def engine_problem(args: argparse.Namespace, engine: str) -> str | None:
    """Why ``engine`` cannot run here, or None."""
    if engine == "llama.cpp" and not args.peer_cmd:
        binary = args.llama_server if args.llama_server.exists() else shutil.which(str(args.llama_server))
        if not binary:
            return f"no llama-server at {args.llama_server} (--llama-server; docs/peer.md says how to build it)"
    return None


def kv_tokens(args: argparse.Namespace) -> int | None:
    """Tokens every engine's KV cache holds: what --kv-cache-gib holds in vLLM's dtype."""
    per_token = kv_bytes_per_token(model_config(args.model_dir), args.vllm_dtype or args.dtype)
    return None if not per_token else math.floor(args.kv_cache_gib * 2**30 / per_token)


def engine_spec(args: argparse.Namespace, engine: str, cfg: ServerConfig) -> ServerSpec:
    """How to launch ``engine`` for ``cfg`` (budget, length) on a fresh free port."""
    tokens = kv_tokens(args)
    if engine in ("evenflow", "vllm"):
        dtype = args.vllm_dtype if engine == "vllm" and args.vllm_dtype else cfg.dtype
        cfg = dataclasses.replace(cfg, dtype=dtype, num_kv_blocks=_blocks(args, tokens))
        spec = server_spec(args, engine, cfg)
        return dataclasses.replace(spec, name=engine)
    if engine in GGUF_EVENFLOW:
        # The dtype flags come last and win over evenflow_argv's --dtype.
        extra = [*args.engine_args.split(), *GGUF_EVENFLOW[engine]]
        cfg = dataclasses.replace(cfg, model_dir=args.gguf, num_kv_blocks=_blocks(args, tokens))
        ns = argparse.Namespace(**{**vars(args), "engine_args": " ".join(extra)})
        spec = server_spec(ns, "evenflow", cfg)
        return dataclasses.replace(spec, name=engine, log_path=args.log_dir / f"{engine}-{cfg.label}-{spec.port}.log")
    return _llama_spec(args, cfg, tokens)


def _blocks(args: argparse.Namespace, tokens: int | None) -> int | None:
    if args.num_kv_blocks is not None or tokens is None:
        return args.num_kv_blocks
    return tokens // args.block_size


def _llama_spec(args: argparse.Namespace, cfg: ServerConfig, tokens: int | None) -> ServerSpec:
    port = free_port()
    log = args.log_dir / f"llama.cpp-{cfg.label}-{port}.log"
    budget = cfg.effective_budget
    # A slot per request that can be in flight: the steady streams and the long prompts beside them.
    slots = min(cfg.max_num_seqs or 256, args.steady_streams + 2)
    ctx = max(tokens or 0, slots * min(cfg.max_model_len, args.steady_prompt_len + args.steady_output_len),
              cfg.max_model_len)
    if args.peer_cmd:
        return ServerSpec("llama.cpp", template_argv(args.peer_cmd, cfg, port), {}, port, log, args.ready_timeout)
    argv = [str(args.llama_server), "-m", str(args.gguf), "--host", "127.0.0.1", "--port", str(port),
            "-t", str(args.threads), "-tb", str(args.threads), "-c", str(ctx), "-np", str(slots), "--kv-unified",
            "--kv-unified-per-slot", str(cfg.max_model_len), "-b", str(budget), "-ub", str(budget), "--metrics",
            *args.peer_args.split()]
    return ServerSpec("llama.cpp", argv, {}, port, log, args.ready_timeout)
