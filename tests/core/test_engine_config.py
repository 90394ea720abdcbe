"""engine-core flags: defaults, sizes, and clear errors for invalid combinations."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from evenflow.core.engine_config import ConfigError, config_from_args, parse_size


@pytest.fixture
def model(tmp_path: Path) -> str:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 10, "max_position_embeddings": 64}))
    return str(tmp_path)


def test_defaults_and_flags(model: str) -> None:
    cfg = config_from_args(["--model", model])
    assert (cfg.listen, cfg.async_scheduling, cfg.enable_prefix_caching) == ("tcp://127.0.0.1:7100", True, True)
    cfg = config_from_args(["--model", model, "--no-async-scheduling", "--no-enable-prefix-caching", "-tp", "2",
                            "--kv-cache-memory", "2GiB", "--listen", "ipc:///tmp/x.sock", "--scheduling-policy",
                            "priority", "--load-format", "dummy"])
    assert not cfg.async_scheduling and not cfg.enable_prefix_caching and cfg.tensor_parallel_size == 2
    assert cfg.kv_cache_memory == 2 * 2**30 and cfg.scheduling_policy == "priority"
    assert "max_num_batched_tokens" in cfg.describe()


def test_adaptive_budget_and_partial_prefill_flags(model: str) -> None:
    cfg = config_from_args(["--model", model])
    assert (cfg.target_itl_ms, cfg.max_num_partial_prefills, cfg.max_long_partial_prefills) == (None, 1, 1)
    assert not cfg.auto_target_itl and cfg.max_num_batched_tokens == 2048  # no flag: the fixed 2048 budget
    cfg = config_from_args(["--model", model, "--target-itl-ms", "40", "--max-num-partial-prefills", "4",
                            "--max-long-partial-prefills", "2"])
    assert (cfg.target_itl_ms, cfg.max_num_partial_prefills, cfg.max_long_partial_prefills) == (40.0, 4, 2)


@pytest.mark.parametrize("flags, mode", [
    ([], (False, None, 2048)),  # neither flag: vLLM's fixed CPU budget
    (["--target-itl-ms", "auto"], (True, None, 2048)),  # the derived target under that budget
    (["--target-itl-ms", "auto", "--max-num-batched-tokens", "512"], (True, None, 512)),
    (["--max-num-batched-tokens", "512"], (False, None, 512)),  # the budget alone: fixed, as in vLLM
    (["--max-num-batched-tokens", "512", "--target-itl-ms", "40"], (False, 40.0, 512)),  # a target, its ceiling
    (["--target-itl-ms", "40"], (False, 40.0, 2048)),
    (["--target-itl-ms", "0"], (False, None, 2048)),  # 0: off, the fixed default budget
])
def test_budget_modes(model: str, flags: list[str], mode: tuple[bool, float | None, int],
                      caplog: pytest.LogCaptureFixture) -> None:
    cfg = config_from_args(["--model", model, *flags])
    assert (cfg.auto_target_itl, cfg.target_itl_ms, cfg.max_num_batched_tokens) == mode
    said = {True: "adaptive, target derived", False: "adaptive, target 40 ms" if mode[1] else "fixed, "}[mode[0]]
    assert cfg.budget_description().startswith(said)  # what the start-up log says of the mode


def test_max_num_seqs_defaults_to_the_budget_when_smaller(model: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="evenflow.core.engine_config"):
        cfg = config_from_args(["--model", model, "--max-num-batched-tokens", "64"])
    assert cfg.max_num_seqs == 64 and "--max-num-seqs not given: using 64" in caplog.text
    assert config_from_args(["--model", model]).max_num_seqs == 256  # vLLM's default when the budget allows it
    assert config_from_args(["--model", model, "--max-num-batched-tokens", "32", "--max-num-seqs", "8"]).max_num_seqs == 8
    with pytest.raises(ConfigError, match="leave --max-num-seqs out"):  # both given and conflicting: still an error
        config_from_args(["--model", model, "--max-num-batched-tokens", "64", "--max-num-seqs", "256"])


def test_policy_choices_come_from_the_scheduler(model: str) -> None:
    from evenflow.core.sched.config import SCHEDULING_POLICIES
    for policy in SCHEDULING_POLICIES:
        assert config_from_args(["--model", model, "--scheduling-policy", policy]).scheduling_policy == policy
    with pytest.raises(SystemExit):
        config_from_args(["--model", model, "--scheduling-policy", "lifo"])


def test_parse_size() -> None:
    assert parse_size("512MB") == 512 * 10**6 and parse_size("1.5k") == 1500 and parse_size("42") == 42


@pytest.mark.parametrize("flags, fragment", [
    (["--listen", "http://x"], "--listen"),
    (["--max-num-seqs", "512", "--max-num-batched-tokens", "256"], "--max-num-seqs"),
    (["--num-kv-blocks", "10", "--kv-cache-memory", "1GiB"], "not both"),
    (["--block-size", "24"], "power of two"),
    (["--tensor-parallel-size", "0"], "tensor-parallel-size"),
    (["--long-prefill-token-threshold", "-1"], "long-prefill"),
    (["--target-itl-ms", "-5"], "--target-itl-ms"),
    (["--max-num-partial-prefills", "2", "--max-long-partial-prefills", "3"], "--max-long-partial-prefills"),
    (["--max-model-len", "0"], "--max-model-len"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
])
def test_invalid_combinations_are_named(model: str, flags: list[str], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        config_from_args(["--model", model, *flags])


def test_missing_model_folder(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config.json"):
        config_from_args(["--model", str(tmp_path / "nope")])
