"""The scheduler's and the workers' config structs, each built from the EngineConfig in one place."""

from __future__ import annotations

from evenflow.protocol import WorkerConfig
from evenflow.protocol.hf_config import read_hf_config

from evenflow.core.engine_config import EngineConfig
from evenflow.core.sched.config import SchedulerConfig


def scheduler_config(cfg: EngineConfig, num_kv_blocks: int, block_size: int, max_model_len: int) -> SchedulerConfig:
    """The scheduler's knobs; the KV pool and block size are what the workers reported."""
    return SchedulerConfig(
        num_kv_blocks=num_kv_blocks, max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_num_seqs=cfg.max_num_seqs, max_model_len=max_model_len, block_size=block_size,
        long_prefill_token_threshold=cfg.long_prefill_token_threshold, policy=cfg.scheduling_policy,
        enable_prefix_caching=cfg.enable_prefix_caching, target_itl_ms=cfg.target_itl_ms,
        auto_target_itl=cfg.auto_target_itl, max_num_partial_prefills=cfg.max_num_partial_prefills,
        max_long_partial_prefills=cfg.max_long_partial_prefills, speculative_config=cfg.speculative_config,
        max_loras=cfg.max_loras if cfg.enable_lora else 0, num_layers=layered_prefill_layers(cfg))


def layered_prefill_layers(cfg: EngineConfig) -> int:
    """The model's layer count where prompts may be prefilled by layer groups (core/sched/layered_prefill.py),
    else 0: only under the adaptive budget, and not beside LoRA, speculation or tensor parallelism."""
    adaptive = cfg.auto_target_itl or cfg.target_itl_ms is not None
    if not (cfg.layered_prefill and adaptive) or cfg.enable_lora or cfg.speculative_config is not None \
            or cfg.tensor_parallel_size > 1:
        return 0
    layers = read_hf_config(cfg.model).text.get("num_hidden_layers")
    return layers if isinstance(layers, int) and layers > 1 else 0


def worker_template(cfg: EngineConfig, model_path: str, max_model_len: int) -> WorkerConfig:
    """Every rank's WorkerConfig but its rank and addresses (the same on every host)."""
    return WorkerConfig(
        model=model_path, world_size=cfg.tensor_parallel_size, dtype=cfg.dtype, device=cfg.device,
        seed=cfg.seed, block_size=cfg.block_size, max_model_len=max_model_len,
        max_num_batched_tokens=cfg.max_num_batched_tokens, max_num_seqs=cfg.max_num_seqs,
        max_step_rows=2 * cfg.max_num_batched_tokens if layered_prefill_layers(cfg) else 0,
        attention_backend=cfg.attention_backend, kv_cache_memory=cfg.kv_cache_memory,
        num_kv_blocks=cfg.num_kv_blocks, load_format=cfg.load_format, num_threads=cfg.worker_threads,
        speculative_config=cfg.speculative_config, quantization=cfg.quantization, lora_config=cfg.lora_config(),
        enforce_eager=cfg.enforce_eager)
