"""The model facts the engine-core needs, read from ``config.json`` / ``generation_config.json``.

The engine-core never imports torch or transformers (start-up must take seconds), so this reads
the JSON directly. Both config dialects are accepted: classic checkpoints carry top-level
``rope_theta`` / ``rope_scaling``; transformers 5 writes ``rope_parameters: {rope_type, ...}``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Keys that different model families use for the trained context length, in order of preference.
_MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length")
# Rope types whose max_position_embeddings already is the extended length (see vLLM's rule).
_ROPE_TYPES_ALREADY_EXTENDED = ("default", "llama3", "longrope", "su", "mrope")


@dataclass(frozen=True)
class ModelInfo:
    """What a frontend and the scheduler need to know about the served model."""

    model_path: str
    model_name: str
    architectures: list[str]
    max_model_len: int  # the model's own limit (before any --max-model-len override)
    vocab_size: int
    eos_token_ids: list[int]


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _rope_source(raw: dict[str, Any]) -> dict[str, Any]:
    """The rope scaling dict from either dialect ({} when there is none)."""
    scaling = raw.get("rope_scaling")
    if isinstance(scaling, dict) and scaling:
        return scaling
    params = raw.get("rope_parameters")
    return params if isinstance(params, dict) else {}


def derive_max_model_len(raw: dict[str, Any]) -> int:
    """The context length the model supports, including rope scaling where it extends it."""
    lengths = [int(raw[k]) for k in _MAX_LEN_KEYS if isinstance(raw.get(k), (int, float))]
    derived = min(lengths) if lengths else 2048
    rope = _rope_source(raw)
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
    path = Path(model_dir).expanduser().resolve()
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"no config.json in model folder {path}")
    try:
        raw = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path} is not valid JSON: {e}") from None
    # Multimodal wrappers keep the language model's facts in text_config.
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    if "vocab_size" not in text:
        raise ValueError(f"{cfg_path} has no vocab_size")
    eos = _as_id_list(text.get("eos_token_id", raw.get("eos_token_id")))
    gen_path = path / "generation_config.json"
    if gen_path.is_file():
        try:
            gen_eos = _as_id_list(json.loads(gen_path.read_text()).get("eos_token_id"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{gen_path} is not valid JSON: {e}") from None
        eos = eos + [e for e in gen_eos if e not in eos]
    return ModelInfo(
        model_path=str(path),
        model_name=served_model_name or path.name,
        architectures=list(raw.get("architectures") or []),
        max_model_len=derive_max_model_len(text),
        vocab_size=int(text["vocab_size"]),
        eos_token_ids=eos,
    )
