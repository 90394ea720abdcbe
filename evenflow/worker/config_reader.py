"""The worker's view of a HuggingFace checkpoint: ``config.json`` as one flat dataclass.

The files are read by ``evenflow.protocol.hf_config`` (shared with the engine-core), which
accepts both config dialects: classic top-level ``rope_theta`` / ``rope_scaling``, and the
transformers-5 ``rope_parameters: {rope_theta, rope_type, ...}`` of freshly saved checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evenflow.protocol.hf_config import read_hf_config, rope_scaling_of

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


@dataclass(frozen=True)
class RopeScaling:
    """A rope scaling (``evenflow.worker.models.rope`` computes it): transformers' ``linear``,
    ``yarn`` and ``llama3``, or ``freq_factors`` (llama.cpp's per-frequency divisors)."""

    rope_type: str
    factor: float = 1.0
    original_max_position_embeddings: int = 0  # yarn, llama3
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn; None: derived from factor (and mscale / mscale_all_dim)
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn
    freq_factors: tuple[float, ...] = ()  # freq_factors


@dataclass(frozen=True)
class ModelConfig:
    """The model facts the worker needs, independent of the config.json dialect."""

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    sliding_window: int | None
    torch_dtype: str  # the checkpoint's dtype name ("float32", "bfloat16", ...)
    eos_token_ids: list[int] = field(default_factory=list)


def _rope(raw: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """Return (rope_theta, scaling or None) from either config dialect (or a GGUF's freq factors)."""
    params = raw.get("rope_parameters") or {}
    theta = float(raw.get("rope_theta", params.get("rope_theta", 10000.0)))
    if raw.get("rope_freq_factors"):
        return theta, RopeScaling("freq_factors", freq_factors=tuple(float(f) for f in raw["rope_freq_factors"]))
    source = rope_scaling_of(raw)
    rope_type = source.get("rope_type", source.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type == "linear":
        return theta, RopeScaling("linear", factor=float(source["factor"]))
    if rope_type == "llama3":
        return theta, RopeScaling(
            "llama3",
            factor=float(source["factor"]),
            low_freq_factor=float(source["low_freq_factor"]),
            high_freq_factor=float(source["high_freq_factor"]),
            original_max_position_embeddings=int(source["original_max_position_embeddings"]),
        )
    if rope_type == "yarn":
        original = int(source["original_max_position_embeddings"])
        factor = source.get("factor") or int(raw.get("max_position_embeddings", original)) / original
        optional = {k: float(source[k]) for k in ("attention_factor", "mscale", "mscale_all_dim") if source.get(k)}
        return theta, RopeScaling(
            "yarn", factor=float(factor), original_max_position_embeddings=original,
            beta_fast=float(source.get("beta_fast") or 32.0), beta_slow=float(source.get("beta_slow") or 1.0),
            truncate=bool(source.get("truncate", True)), **optional,
        )
    raise ValueError(f"unsupported rope_scaling type {rope_type!r} (supported: default, linear, yarn, llama3)")


def _sliding_window(raw: dict[str, Any]) -> int | None:
    """The effective sliding window, or None when every layer attends to its full context."""
    window = raw.get("sliding_window")
    if window is None:
        return None
    # Qwen2/3 carry a window that is off unless use_sliding_window is set.
    if raw.get("model_type", "").startswith("qwen") and not raw.get("use_sliding_window", False):
        return None
    return int(window)


def read_model_config(model_dir: str | Path) -> ModelConfig:
    """Parse ``model_dir/config.json`` (+ generation_config.json for EOS ids).

    Raises ValueError naming the architecture when it is not one this worker implements.
    """
    hf = read_hf_config(model_dir)
    raw = hf.text
    # A config.json without ``architectures`` (transformers' GGUF loader writes none) is read the
    # way transformers' auto classes read it: by its model_type.
    archs = hf.raw.get("architectures") or [a for a in SUPPORTED_ARCHITECTURES
                                            if a.removesuffix("ForCausalLM").lower() == raw.get("model_type")]
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(
            f"unsupported model architecture {archs!r} in {hf.path / 'config.json'}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    theta, scaling = _rope(raw)
    num_heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    head_dim = raw.get("head_dim") or hidden // num_heads
    dtype = raw.get("torch_dtype") or raw.get("dtype") or "float32"
    return ModelConfig(
        architecture=arch,
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        vocab_size=int(raw["vocab_size"]),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
        qk_norm=arch == "Qwen3ForCausalLM",
        sliding_window=_sliding_window(raw),
        torch_dtype=str(dtype),
        eos_token_ids=hf.eos_token_ids,
    )
