"""The shared config reader: both dialects, multimodal wrappers, EOS ids from both files, and
errors that name the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from evenflow.protocol.hf_config import read_hf_config, rope_scaling_of


def write(folder: Path, config: object, generation: object | None = None) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


def test_text_config_and_eos_from_both_files(tmp_path: Path) -> None:
    cfg = read_hf_config(write(tmp_path / "m", {"architectures": ["X"], "text_config": {"vocab_size": 9,
                                                "eos_token_id": 2}}, {"eos_token_id": [2, 7]}))
    assert cfg.text == {"vocab_size": 9, "eos_token_id": 2}
    assert cfg.raw["architectures"] == ["X"]
    assert cfg.eos_token_ids == [2, 7]
    assert cfg.path == (tmp_path / "m").resolve()


def test_rope_scaling_in_either_dialect() -> None:
    llama3 = {"rope_type": "llama3", "factor": 8.0}
    assert rope_scaling_of({"rope_theta": 1e4, "rope_scaling": llama3}) == llama3
    assert rope_scaling_of({"rope_parameters": {"rope_theta": 1e4, **llama3}})["factor"] == 8.0
    assert rope_scaling_of({"rope_scaling": None}) == {}


@pytest.mark.parametrize(("config", "message"), [("{not json", "is not valid JSON"), ("[1, 2]", "JSON object")])
def test_bad_files_are_named(tmp_path: Path, config: str, message: str) -> None:
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(ValueError, match=message) as err:
        read_hf_config(tmp_path)
    assert "config.json" in str(err.value)
    with pytest.raises(ValueError, match="no config.json"):
        read_hf_config(tmp_path / "missing")
