"""EngineConfig: every knob of the engine-core process, its command line, and its validation."""

from __future__ import annotations

import argparse
import logging
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Sequence

from evenflow.protocol import MAX_FRAME_BYTES, SpeculativeConfig, parse_speculative_config
from evenflow.protocol.curve import is_loopback
from evenflow.protocol.gguf_file import is_gguf_path
from evenflow.protocol.lora import LoRAConfig, parse_lora_module, read_adapter
from evenflow.protocol.liveness import DEFAULT_SILENCE_TIMEOUT_S

from evenflow.core.step_watchdog import DEFAULT_STEP_TIMEOUT_S

from evenflow.core.sched.config import (DEFAULT_MAX_NUM_SEQS, SCHEDULING_POLICIES, ConfigError, budget_mode,
                                        check_prefill_limits, check_scheduler_limits)

__all__ = ["ConfigError", "EngineConfig", "build_parser", "config_from_args", "parse_size"]
log = logging.getLogger("evenflow.core.engine_config")

DEFAULT_LISTEN = "tcp://127.0.0.1:7100"
_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
               "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30}


@dataclass
class EngineConfig:
    """Everything the engine-core, its scheduler, its cache and its workers take."""

    model: str
    listen: str = DEFAULT_LISTEN
    served_model_name: str | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS  # the command line's default is min(this, the budget)
    max_model_len: int | None = None  # None: the model's own limit
    block_size: int = 16
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    enable_prefix_caching: bool = True
    kv_cache_memory: int | None = None  # bytes per worker; None: sized by the worker
    num_kv_blocks: int | None = None
    dtype: str = "auto"
    quantization: str | None = None  # None: follows --dtype (auto: GGUF Q4 projections 4-bit where faster)
    enforce_eager: bool = False  # True: no torch.compile'd ops (models/compiled_ops.py)
    layered_prefill: bool = True  # under the adaptive budget: a prompt beside decodes by layer groups
    device: str = "auto"
    seed: int = 0
    tensor_parallel_size: int = 1
    attention_backend: str = "auto"
    async_scheduling: bool = True
    load_format: str = "auto"
    max_frame_bytes: int = MAX_FRAME_BYTES
    worker_start_timeout: float = 600.0
    # A frontend silent this long (of the engine's running time) is dropped and its requests aborted;
    # a frontend that died is noticed by its closed connection instead, in milliseconds.
    client_timeout: float = DEFAULT_SILENCE_TIMEOUT_S
    step_timeout: float = DEFAULT_STEP_TIMEOUT_S  # a step running longer: the workers hang (step_watchdog.py)
    worker_threads: int | None = None
    # Reliability (admission limits, deadlines): None / 0 = off.
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None
    request_timeout: float = 0.0
    # Security of the frontend link: a non-loopback --listen must be asked for; CURVE keys folder.
    allow_remote: bool = False
    curve_keys: str | None = None
    # Tensor parallel across hosts (evenflow/core/multi_node.py): ranks split evenly over --nnodes hosts.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = ""  # node 0's address on the interface the hosts share; the links bind there
    master_port: int = 29501  # torch.distributed rendezvous; +1: step broadcast, +2: results
    headless: bool = False  # a worker launcher for node_rank >= 1: no scheduler, no frontend port
    dist_secret_file: str | None = None  # shared secret of every host (else $EVENFLOW_DIST_SECRET)
    # Adaptive budget and partial-prefill bounds (evenflow/core/sched/budget_controller.py, evenflow/core/sched/prefill_gate.py).
    target_itl_ms: float | None = None
    auto_target_itl: bool = False  # set by the command line when neither budget flag is given
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1
    speculative_config: SpeculativeConfig | None = None  # --speculative-config JSON, validated when parsed
    # Multi-LoRA (vLLM's flags; docs/lora.md).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras
    lora_modules: list[str] = field(default_factory=list)  # name=path

    def lora_config(self) -> LoRAConfig | None:
        """What the workers take (None: LoRA off)."""
        if not self.enable_lora:
            return None
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras or self.max_loras)

    def validate(self) -> None:
        """Raise ConfigError naming the first invalid value or combination."""
        if not re.match(r"^(tcp://[^\s]+:\d+|ipc://.+)$", self.listen):
            raise ConfigError(f"--listen must be tcp://HOST:PORT or ipc://PATH, got {self.listen!r}")
        check_scheduler_limits(self.max_num_batched_tokens, self.max_num_seqs, self.block_size,
                               self.long_prefill_token_threshold, self.scheduling_policy, self.max_model_len)
        for name in ("tensor_parallel_size", "max_frame_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                f"--max-num-batched-tokens ({self.max_num_batched_tokens}) must be >= --max-num-seqs "
                f"({self.max_num_seqs}): every running request needs one token of each step's budget "
                f"(leave --max-num-seqs out to default it to min({DEFAULT_MAX_NUM_SEQS}, the budget))")
        if self.load_format not in ("auto", "dummy"):
            raise ConfigError(f"--load-format must be auto or dummy, got {self.load_format!r}")
        if self.kv_cache_memory is not None and self.num_kv_blocks is not None:
            raise ConfigError("give --kv-cache-memory or --num-kv-blocks, not both")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ConfigError(f"--kv-cache-memory must be positive, got {self.kv_cache_memory}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"--num-kv-blocks must be >= 1, got {self.num_kv_blocks}")
        if self.worker_start_timeout <= 0 or self.client_timeout <= 0 or self.step_timeout <= 0:
            raise ConfigError("--worker-start-timeout, --client-timeout and --step-timeout must be positive")
        check_prefill_limits(self.max_num_partial_prefills, self.max_long_partial_prefills, self.target_itl_ms)
        if self.auto_target_itl and self.target_itl_ms is not None:
            raise ConfigError("auto_target_itl (no budget flag given) and --target-itl-ms exclude each other")
        for name in ("max_num_queued_reqs", "max_num_queued_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not (0.0 <= self.request_timeout < float("inf")):
            raise ConfigError(f"--request-timeout must be >= 0 (0: none), got {self.request_timeout}")
        if not is_loopback(self.listen) and not self.allow_remote:
            raise ConfigError(f"--listen {self.listen} is not a loopback or ipc:// address: pass --allow-remote "
                              f"if it is meant (and --curve-keys DIR to encrypt and authenticate the link)")
        if self.curve_keys is not None and not (Path(self.curve_keys) / "engine.key_secret").is_file():
            raise ConfigError(f"--curve-keys {self.curve_keys!r} has no engine.key_secret "
                              f"(write the keys with `evenflow keygen DIR`)")
        self._validate_nodes()
        self._validate_lora()
        if self.speculative_config is not None and (problem := self.speculative_config.validate()):
            raise ConfigError(f"--speculative-config: {problem}")
        if not is_gguf_path(self.model) and not (Path(self.model).expanduser() / "config.json").is_file():
            raise ConfigError(f"--model {self.model!r} is neither a folder with a config.json nor a .gguf file")

    def _validate_nodes(self) -> None:
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank must be in [0, --nnodes={self.nnodes}), got {self.node_rank}")
        if self.nnodes == 1:
            if self.headless:
                raise ConfigError("--headless is a worker launcher for the other hosts: it needs --nnodes > 1")
            return
        if self.tensor_parallel_size % self.nnodes:
            raise ConfigError(f"--tensor-parallel-size {self.tensor_parallel_size} must split evenly over "
                              f"--nnodes {self.nnodes}")
        if not self.master_addr:
            raise ConfigError("--nnodes > 1 needs --master-addr: node 0's address on the interface the hosts "
                              "share (the step and result links bind only there)")
        if not 1 <= self.master_port <= 65533:
            raise ConfigError(f"--master-port must be in [1, 65533] (it and the next two ports are used), "
                              f"got {self.master_port}")
        if (self.node_rank > 0) != self.headless:
            raise ConfigError("node 0 runs the engine-core; every other --node-rank runs `engine-core --headless`")

    def _validate_lora(self) -> None:
        if not self.enable_lora:
            if self.lora_modules:
                raise ConfigError("--lora-modules needs --enable-lora")
            return
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ConfigError(f"--max-loras and --max-lora-rank must be >= 1, got {self.max_loras}, {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"--max-cpu-loras ({self.max_cpu_loras}) must be >= --max-loras ({self.max_loras})")
        for entry in self.lora_modules:
            try:
                read_adapter(parse_lora_module(entry)[1], self.max_lora_rank)
            except ValueError as e:
                raise ConfigError(f"--lora-modules {entry}: {e}") from None

    def budget_description(self) -> str:
        """The token budget's mode in words, for the start-up log (after the model was accepted)."""
        if self.auto_target_itl:
            return f"adaptive, target derived from the decode and prompt steps, ceiling {self.max_num_batched_tokens} tokens"
        if self.target_itl_ms is not None:
            return f"adaptive, target {self.target_itl_ms:g} ms, ceiling {self.max_num_batched_tokens} tokens"
        return f"fixed, {self.max_num_batched_tokens} tokens a step"

    def describe(self) -> str:
        """One line per setting, for the start-up log."""
        return "\n".join(f"  {f.name:<30} {getattr(self, f.name)!r}" for f in fields(self))


def parse_size(text: str) -> int:
    """Parse a byte count: ``1073741824``, ``4GiB``, ``512MB``, ``2g``."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 2GiB, 512MB, 1073741824)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def build_parser() -> argparse.ArgumentParser:
    """The ``engine-core`` command line; defaults come from EngineConfig."""
    d = EngineConfig(model="")
    p = argparse.ArgumentParser(
        prog="engine-core",
        description="evenflow engine-core: scheduler + KV cache + workers, serving frontends over ZMQ.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    a = p.add_argument
    a("--model", required=True, help="model folder (HuggingFace layout: config.json, *.safetensors) or a .gguf file")
    a("--listen", default=d.listen, help="ZMQ address the ROUTER binds for frontends (tcp:// or ipc://)")
    a("--served-model-name", default=None, help="model name reported to frontends (default: folder name)")
    a("--max-num-batched-tokens", type=int, default=None,
      help=f"token budget of one step; given alone, every step's fixed budget (default {d.max_num_batched_tokens}, "
           f"then the ceiling of the adaptive budget, see --target-itl-ms)")
    a("--max-num-seqs", type=int, default=None,
      help=f"most requests running at once (default: min({DEFAULT_MAX_NUM_SEQS}, --max-num-batched-tokens))")
    a("--max-model-len", type=int, default=None, help="longest prompt+output (default: the model's limit)")
    a("--block-size", type=int, default=d.block_size, help="tokens per KV cache block")
    a("--long-prefill-token-threshold", type=int, default=d.long_prefill_token_threshold,
      help="cap on one request's prefill chunk per step (0: no cap)")
    a("--scheduling-policy", choices=SCHEDULING_POLICIES, default=d.scheduling_policy,
      help="fcfs, or priority (smaller value first, then arrival)")
    a("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=d.enable_prefix_caching,
      help="prefix caching (on; --no-enable-prefix-caching turns it off)")
    a("--kv-cache-memory", type=parse_size, default=None,
      help="KV cache bytes per worker, on CPU and CUDA (e.g. 2GiB; default: CPU a share of free RAM, "
           "CUDA 90%% of the device after the weights and the largest step)")
    a("--num-kv-blocks", type=int, default=None, help="exact number of KV blocks (overrides sizing)")
    a("--dtype", default=d.dtype, help="model dtype: auto, float32, float16, bfloat16")
    a("--quantization", "-q", choices=("gguf", "none"), default=None,
      help="GGUF Q4_0/Q4_1 projections: gguf keeps them 4-bit (int4 kernel), none dequantizes them to --dtype "
           "(default: with --dtype auto keep them 4-bit where a start-up measurement finds the int4 kernel "
           "faster; an explicit --dtype dequantizes them to it)")
    a("--enforce-eager", action=argparse.BooleanOptionalAction, default=d.enforce_eager,
      help="never torch.compile: on CPU, 4-bit GGUF weights otherwise get their layers' elementwise ops compiled "
           "for steps of many rows at start-up (a few seconds; cached by inductor between runs)")
    a("--layered-prefill", action=argparse.BooleanOptionalAction, default=d.layered_prefill,
      help="under --target-itl-ms: a prompt beside decoding streams runs all its tokens through a few layers a "
           "step (its work that of one unchunked step) rather than in token chunks; off with LoRA, speculative "
           "decoding and tensor parallelism")
    a("--device", default=d.device, help="worker device: auto, cpu, cuda")
    a("--seed", type=int, default=d.seed, help="random seed of the workers")
    a("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size, help="worker processes (ranks)")
    a("--attention-backend", default=d.attention_backend, choices=("auto", "torch", "triton", "flash_attn"),
      help="attention kernels: auto picks flash_attn on CUDA when it imports and is >= 2.5.7 (half precision), "
           "else triton on CUDA, torch on CPU")
    a("--async-scheduling", action=argparse.BooleanOptionalAction, default=d.async_scheduling,
      help="overlap: schedule step N+1 while step N runs (on; --no-async-scheduling schedules it after N's results)")
    a("--load-format", choices=("auto", "dummy"), default=d.load_format,
      help="auto: the GGUF file's or the folder's safetensors weights; dummy: random weights from the config alone")
    a("--max-frame-bytes", type=int, default=d.max_frame_bytes, help="largest frontend frame accepted")
    a("--worker-start-timeout", type=float, default=d.worker_start_timeout,
      help="seconds to wait for every worker's handshake")
    a("--client-timeout", type=float, default=d.client_timeout,
      help="seconds of silence (of this process's running time: its own pauses do not count) after which a "
           "frontend is dropped and its requests aborted; a frontend that exits is noticed at once by its "
           "closed connection")
    a("--step-timeout", type=float, default=d.step_timeout,
      help="seconds one step may run (of this process's running time) before the engine-core counts its workers "
           "as hung, fails every request with that cause and exits non-zero; a step 10x past its predicted time "
           "is logged with its shape first")
    a("--worker-threads", type=int, default=None,
      help="torch threads per worker for every step (default on CPU: a step estimated to take 15 ms or more "
           "on one thread uses every core, a shorter one leaves one free; divided by tensor-parallel-size)")
    a("--target-itl-ms", type=_target_itl_ms, default=None,
      help="adaptive token budget: each step carries as much prefill as keeps the streams' p99 inter-token "
           "latency (step times fitted online) at this many ms; --max-num-batched-tokens becomes the upper "
           "bound; 'auto': a target derived from the measured steps (max(50 ms, 8x the decode step, a sixth of a "
           "whole-budget prompt step)); "
           "0 or unset: off (the fixed budget)")
    a("--max-num-partial-prefills", type=int, default=d.max_num_partial_prefills,
      help="when > 1: most requests with a prefill chunk in one step (vLLM V0)")
    a("--max-long-partial-prefills", type=int, default=d.max_long_partial_prefills,
      help="when --max-num-partial-prefills > 1: most of them longer than --long-prefill-token-threshold "
           "(default then 4%% of max-model-len); shorter prompts go ahead of long ones that have no slot")
    a("--max-num-queued-reqs", type=int, default=None,
      help="refuse new requests (overloaded; HTTP 503) while the engine holds this many (waiting + running)")
    a("--max-num-queued-tokens", type=int, default=None,
      help="refuse a new request (overloaded; HTTP 503) when its prompt would bring the prompt tokens not yet "
           "computed over this")
    a("--request-timeout", type=float, default=d.request_timeout,
      help="seconds after which a request is aborted with request_timeout (0: none); a request's own "
           "timeout (X-Request-Timeout header, AddRequest.timeout_s) overrides it")
    a("--allow-remote", action=argparse.BooleanOptionalAction, default=False,
      help="allow a --listen address that is not loopback or ipc:// (use --curve-keys with it)")
    a("--curve-keys", default=None,
      help="folder from `evenflow keygen DIR`: CURVE-encrypt the frontend link and serve only the frontends "
           "whose public keys are in DIR/authorized_clients")
    g = p.add_argument_group("tensor parallel across hosts")
    g.add_argument("--nnodes", type=int, default=d.nnodes, help="hosts the tensor-parallel ranks are split over")
    g.add_argument("--node-rank", type=int, default=d.node_rank, help="this host's index (0: the engine-core)")
    g.add_argument("--master-addr", default=d.master_addr,
                   help="node 0's address on the interface the hosts share (required with --nnodes > 1)")
    g.add_argument("--master-port", type=int, default=d.master_port,
                   help="torch.distributed rendezvous port on node 0; the next two carry steps and results")
    g.add_argument("--headless", action=argparse.BooleanOptionalAction, default=False, help="run only this host's worker ranks (node-rank >= 1)")
    g.add_argument("--dist-secret-file", default=None,
                   help="file with the secret shared by every host (default: $EVENFLOW_DIST_SECRET)")
    a("--speculative-config", type=_speculative_config, default=None,
      help='speculative decoding, as vLLM: \'{"method": "ngram", "num_speculative_tokens": 3, '
           '"prompt_lookup_min": 2, "prompt_lookup_max": 4}\' (optional "disable_by_batch_size": N: '
           'no drafts while N or more requests run; default 16, null: never)')
    g = p.add_argument_group("LoRA adapters (docs/lora.md)")
    g.add_argument("--enable-lora", action=argparse.BooleanOptionalAction, default=False, help="serve PEFT LoRA adapters of the model")
    g.add_argument("--max-loras", type=int, default=d.max_loras, help="most adapters in one step (worker slots)")
    g.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank, help="largest adapter rank accepted")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept in each worker's host memory (default: --max-loras)")
    g.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="adapters to serve from the start: name=path of a PEFT folder; requests choose one "
                        "by its name in the model field")
    return p


def _speculative_config(text: str) -> SpeculativeConfig:
    try:
        return parse_speculative_config(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--speculative-config: ")) from None  # argparse names it


def _target_itl_ms(text: str) -> float | str:
    """``--target-itl-ms``: milliseconds, or ``auto``."""
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected milliseconds or 'auto', got {text!r}") from None


def config_from_args(argv: Sequence[str] | None = None) -> EngineConfig:
    """Parse the command line into a validated EngineConfig (ConfigError when invalid)."""
    ns = build_parser().parse_args(argv)
    mode = budget_mode(ns.target_itl_ms)
    if ns.max_num_batched_tokens is None:
        ns.max_num_batched_tokens = EngineConfig.max_num_batched_tokens
    ns.auto_target_itl = mode == "auto"
    if mode != "target":
        ns.target_itl_ms = None  # 0, or auto: the controller derives its own
    if ns.max_num_seqs is None:
        # vLLM's 256 would make a small budget (32, 64: what docs/tuning.md recommends against
        # stalls) an error on its own; a budget of B tokens runs at most B requests anyway.
        ns.max_num_seqs = min(DEFAULT_MAX_NUM_SEQS, ns.max_num_batched_tokens)
        if ns.max_num_seqs < DEFAULT_MAX_NUM_SEQS:
            log.info("--max-num-seqs not given: using %d (min(%d, --max-num-batched-tokens %d))", ns.max_num_seqs,
                     DEFAULT_MAX_NUM_SEQS, ns.max_num_batched_tokens)
    cfg = EngineConfig(**vars(ns))
    cfg.validate()
    return cfg
