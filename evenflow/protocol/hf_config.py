"""Reading a HuggingFace checkpoint folder's ``config.json`` and ``generation_config.json``,
or a GGUF file's metadata in the same terms (``evenflow.protocol.gguf_config``).

Shared by the engine-core (the facts it schedules with: context length, vocabulary, EOS ids) and
the workers (the architecture they build), so both read the files the same way. Plain JSON, no
torch or transformers. Both config dialects exist in the wild: classic checkpoints carry
top-level ``rope_theta`` / ``rope_scaling``; transformers 5 writes ``rope_parameters``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evenflow.protocol.gguf_file import is_gguf_path


@dataclass(frozen=True)
class HFConfig:
    """A checkpoint folder's configuration as read from disk."""

    path: Path  # the folder (or the GGUF file), resolved
    raw: dict[str, Any]  # config.json (or the GGUF metadata as config.json would say it)
    text: dict[str, Any]  # the language model's part: ``text_config`` of multimodal wrappers, else raw
    eos_token_ids: list[int]  # config.json's, then generation_config.json's, without repeats


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def read_hf_config(model_dir: str | Path) -> HFConfig:
    """Read ``model_dir/config.json`` (+ ``generation_config.json`` for EOS ids), or a GGUF file.

    Raises ValueError naming the file when the folder has no usable config.
    """
    path = Path(model_dir).expanduser().resolve()
    if is_gguf_path(path):
        from evenflow.protocol.gguf_config import gguf_to_hf_config

        raw, eos = gguf_to_hf_config(path)
        return HFConfig(path, raw, raw, eos)
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"no config.json in model folder {path}")
    raw = _read_json(cfg_path)
    text = raw["text_config"] if isinstance(raw.get("text_config"), dict) else raw
    eos = _as_id_list(text.get("eos_token_id", raw.get("eos_token_id")))
    gen_path = path / "generation_config.json"
    if gen_path.is_file():
        eos += [e for e in _as_id_list(_read_json(gen_path).get("eos_token_id")) if e not in eos]
    return HFConfig(path, raw, text, eos)


def rope_scaling_of(config: dict[str, Any]) -> dict[str, Any]:
    """The rope scaling parameters from either dialect ({} when there are none). In the
    transformers-5 dialect they sit in ``rope_parameters`` next to ``rope_theta``."""
    scaling = config.get("rope_scaling")
    if isinstance(scaling, dict) and scaling:
        return scaling
    params = config.get("rope_parameters")
    return params if isinstance(params, dict) else {}
