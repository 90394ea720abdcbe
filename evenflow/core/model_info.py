"""The model facts the engine-core needs, read from the checkpoint's config files.

The engine-core never imports torch or transformers (start-up must take seconds); the files are
read by ``evenflow.protocol.hf_config``, the reader the workers use too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evenflow.protocol.hf_config import read_hf_config, rope_scaling_of

# Keys that different model families use for the trained context length, in order of preference.
_MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length")
# Rope types whose max_position_embeddings already is the extended length (see vLLM's rule).
_ROPE_TYPES_ALREADY_EXTENDED = ("default", "llama3", "longrope", "su", "mrope")


@dataclass(frozen=True)
class ModelInfo:
    """What a frontend and the scheduler need to know about the served model."""

    model_path: str
    model_name: str  # --served-model-name, else the --model string as given (vLLM's rule)
    architectures: list[str]
    max_model_len: int  # the model's own limit (before any --max-model-len override)
    vocab_size: int
    eos_token_ids: list[int]
    model_aliases: tuple[str, ...] = ()  # the folder's base name, when model_name is not already it


def derive_max_model_len(raw: dict[str, Any]) -> int:
    """The context length the model supports, including rope scaling where it extends it."""
    lengths = [int(raw[k]) for k in _MAX_LEN_KEYS if isinstance(raw.get(k), (int, float))]
    derived = min(lengths) if lengths else 2048
    rope = rope_scaling_of(raw)
    rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
    factor = rope.get("factor")
    if rope_type not in _ROPE_TYPES_ALREADY_EXTENDED and isinstance(factor, (int, float)):
        if rope_type == "yarn" and "original_max_position_embeddings" in rope:
            derived = int(rope["original_max_position_embeddings"])
        derived = int(derived * float(factor))
    return derived


def read_model_info(model_dir: str | Path, served_model_name: str | None = None) -> ModelInfo:
    """Read ``model_dir/config.json`` (+ ``generation_config.json`` for EOS ids).

    Raises ValueError with the file name when the folder has no usable config.
    """
    cfg = read_hf_config(model_dir)
    if "vocab_size" not in cfg.text:
        raise ValueError(f"{cfg.path / 'config.json'} has no vocab_size")
    # Clients copied from a vLLM setup send the --model string; older evenflow clients sent the
    # folder's base name, which stays an alias. An explicit served name replaces both, as in vLLM.
    model_name = served_model_name or str(model_dir)
    aliases = () if served_model_name or cfg.path.name == model_name else (cfg.path.name,)
    return ModelInfo(
        model_path=str(cfg.path),
        model_name=model_name,
        model_aliases=aliases,
        architectures=list(cfg.raw.get("architectures") or []),
        max_model_len=derive_max_model_len(cfg.text),
        vocab_size=int(cfg.text["vocab_size"]),
        eos_token_ids=cfg.eos_token_ids,
    )
