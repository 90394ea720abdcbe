"""Model facts read from config.json without torch, in both config dialects."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evenflow.core.model_info import read_model_info


def write(folder: Path, config: dict, generation: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


def test_classic_llama3_config(tmp_path: Path) -> None:
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "max_position_embeddings": 131072,
           "eos_token_id": 128001, "rope_theta": 500000.0,
           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}}
    info = read_model_info(write(tmp_path / "m", cfg, {"eos_token_id": [128001, 128009]}), "served")
    assert (info.max_model_len, info.vocab_size, info.model_name) == (131072, 128256, "served")
    assert info.eos_token_ids == [128001, 128009]


def test_transformers5_rope_parameters_and_yarn(tmp_path: Path) -> None:
    cfg = {"vocab_size": 100, "max_position_embeddings": 4096,
           "rope_parameters": {"rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0,
                               "original_max_position_embeddings": 4096}}
    info = read_model_info(write(tmp_path / "q", cfg))
    assert info.max_model_len == 16384 and info.eos_token_ids == []


def test_served_under_the_model_string_as_given_with_the_base_name_as_alias(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    folder = write(tmp_path / "models" / "Llama-3-8B", {"vocab_size": 10})
    given = str(tmp_path / "models" / "." / "Llama-3-8B")  # as typed: not normalized, as vLLM serves it
    info = read_model_info(given)
    assert info.model_name == given and info.model_aliases == ("Llama-3-8B",)
    assert read_model_info(folder, "served").model_aliases == ()  # --served-model-name replaces both, as in vLLM
    monkeypatch.chdir(folder.parent)
    bare = read_model_info("Llama-3-8B")  # the string already is the base name: no alias to add
    assert bare.model_name == "Llama-3-8B" and bare.model_aliases == ()


def test_tiny_llama_checkpoint(tiny_llama: Path) -> None:
    info = read_model_info(tiny_llama)
    assert (info.vocab_size, info.max_model_len, info.eos_token_ids) == (256, 512, [2])


def test_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no config.json"):
        read_model_info(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_model_info(tmp_path)
