"""--speculative-config: vLLM's JSON, its defaults, and clear start-up errors (one validation)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from evenflow.core.engine_config import ConfigError, config_from_args
from evenflow.frontend.llm import engine_args_to_flags
from evenflow.protocol import SpeculativeConfig, parse_speculative_config


@pytest.fixture
def model(tmp_path: Path) -> str:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 10, "max_position_embeddings": 64}))
    return str(tmp_path)


def test_flag_parses_vllm_json(model: str) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    cfg = config_from_args(["--model", model, "--speculative-config", json.dumps(spec)])
    assert cfg.speculative_config == SpeculativeConfig("ngram", 4, 2, 5)
    assert config_from_args(["--model", model]).speculative_config is None


def test_disable_by_batch_size_defaults_to_16_and_null_means_never() -> None:
    assert parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 2}').disable_by_batch_size == 16
    never = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": null}')
    assert never.disable_by_batch_size is None
    # The worker receives what the engine-core parsed, "never" included.
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(never), type=SpeculativeConfig).disable_by_batch_size is None


def test_lookup_defaults_follow_vllm() -> None:
    both_unset = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (both_unset.ngram_min, both_unset.ngram_max) == (5, 5)
    only_max = parse_speculative_config('{"method": "[ngram]", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (only_max.method, only_max.ngram_min, only_max.ngram_max) == ("ngram", 4, 4)


@pytest.mark.parametrize("spec, message", [
    ({"method": "eagle", "num_speculative_tokens": 3}, "method 'eagle' is not supported"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min must be >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "must be <= prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1}, "disable_by_batch_size"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}, "unknown field `draft_model`"),
])
def test_bad_values_are_a_clear_start_up_error(model: str, spec: dict, message: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        config_from_args(["--model", model, "--speculative-config", json.dumps(spec)])
    assert message in capsys.readouterr().err
    with pytest.raises(ValueError, match="--speculative-config"):
        parse_speculative_config(json.dumps(spec))


def test_not_json_is_a_clear_error(model: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        config_from_args(["--model", model, "--speculative-config", "ngram"])
    assert "--speculative-config" in capsys.readouterr().err


def test_validate_catches_a_config_built_in_code(model: str) -> None:
    cfg = config_from_args(["--model", model])
    cfg.speculative_config = SpeculativeConfig("ngram", -1)
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        cfg.validate()


def test_llm_passes_a_dict_as_json() -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    assert engine_args_to_flags({"speculative_config": spec}) == ["--speculative-config", json.dumps(spec)]
