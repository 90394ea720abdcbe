"""Where each HuggingFace tensor of a Llama-family checkpoint goes in the model's fused, sharded
parameters (evenflow/worker/models/llama.py): the loader (evenflow/worker/loader.py) fills them by it."""

from __future__ import annotations

from dataclasses import dataclass

from evenflow.worker.config_reader import ModelConfig


@dataclass(frozen=True)
class WeightSpec:
    """Where one HuggingFace tensor goes: a parameter, which dim is sharded, at which row offset."""

    param: str
    shard_dim: int | None  # None: replicated; 0: rows (column-parallel); 1: columns (row-parallel)
    row_offset: int = 0  # for fused parameters: the first row this tensor's shard fills


def llama_weight_specs(cfg: ModelConfig, q: int, kv: int, inter: int) -> dict[str, WeightSpec]:
    """HuggingFace tensor name -> where it goes; ``q``, ``kv``, ``inter``: this rank's q and k (or v)
    rows and intermediate size, the offsets of the fused parts."""
    specs: dict[str, WeightSpec] = {
        "model.embed_tokens.weight": WeightSpec("embed", 0),
        "model.norm.weight": WeightSpec("norm", None),
    }
    if not cfg.tie_word_embeddings:
        specs["lm_head.weight"] = WeightSpec("lm_head", 0)
    for i in range(cfg.num_layers):
        p, a, m = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        specs[p + "input_layernorm.weight"] = WeightSpec(f"layers.{i}.input_norm", None)
        specs[p + "post_attention_layernorm.weight"] = WeightSpec(f"layers.{i}.post_norm", None)
        for name, offset in (("q_proj", 0), ("k_proj", q), ("v_proj", q + kv)):
            specs[a + name + ".weight"] = WeightSpec(f"layers.{i}.qkv", 0, offset)
            if cfg.qkv_bias:
                specs[a + name + ".bias"] = WeightSpec(f"layers.{i}.qkv_bias", 0, offset)
        if cfg.qk_norm:
            specs[a + "q_norm.weight"] = WeightSpec(f"layers.{i}.q_norm", None)
            specs[a + "k_norm.weight"] = WeightSpec(f"layers.{i}.k_norm", None)
        specs[a + "o_proj.weight"] = WeightSpec(f"layers.{i}.o", 1)
        specs[m + "gate_proj.weight"] = WeightSpec(f"layers.{i}.gate_up", 0, 0)
        specs[m + "up_proj.weight"] = WeightSpec(f"layers.{i}.gate_up", 0, inter)
        specs[m + "down_proj.weight"] = WeightSpec(f"layers.{i}.down", 1)
    return specs
