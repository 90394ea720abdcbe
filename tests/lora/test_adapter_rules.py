"""What an adapter folder must be, and the adapter's identity: clear reasons for every refusal."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from evenflow.core.engine_config import ConfigError, config_from_args
from evenflow.core.lora_registry import LoRARegistry
from evenflow.protocol.lora import adapter_identity, parse_lora_module, read_adapter


def copy(adapter: Path, tmp_path: Path, name: str = "copy") -> Path:
    out = tmp_path / name
    shutil.copytree(adapter, out)
    return out


def test_a_peft_folder_is_read_with_its_scaling(lora_adapters: dict[str, Path]) -> None:
    plain = read_adapter(lora_adapters["all"], 16, num_layers=2)
    assert (plain.rank, plain.scaling, plain.num_layers) == (4, 8.0 / 4, 2)
    assert plain.targets == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    rslora = read_adapter(lora_adapters["attn"], 16)
    assert rslora.use_rslora and rslora.scaling == pytest.approx(4.0 / 8**0.5)
    assert rslora.targets == ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.mark.parametrize("case, reason", [
    ("missing", "is not a folder"),
    ("no_config", "has no adapter_config.json"),
    ("no_weights", "has no adapter_model.safetensors"),
    ("rank", "has rank 4, above --max-lora-rank 2"),
    ("target", "unknown target module"),
    ("dora", "DoRA"),
    ("layers", "targets layer 1; the model has 1"),
])
def test_bad_adapters_are_refused_with_the_reason(lora_adapters: dict[str, Path], tmp_path: Path, case: str,
                                                  reason: str) -> None:
    folder, max_rank, num_layers = copy(lora_adapters["all"], tmp_path), 16, 2
    if case == "missing":
        folder = tmp_path / "nowhere"
    elif case == "no_config":
        (folder / "adapter_config.json").unlink()
    elif case == "no_weights":
        (folder / "adapter_model.safetensors").unlink()
    elif case == "rank":
        max_rank = 2
    elif case == "target":
        save_file({"base_model.model.model.embed_tokens.lora_A.weight": torch.zeros(4, 256)},
                  str(folder / "adapter_model.safetensors"))
    elif case == "dora":
        config = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    elif case == "layers":
        num_layers = 1
    with pytest.raises(ValueError, match=reason):
        read_adapter(folder, max_rank, num_layers)


def test_identity_follows_the_weights_not_the_name_or_path(lora_adapters: dict[str, Path], tmp_path: Path) -> None:
    config = read_adapter(lora_adapters["all"], 16)
    same = copy(lora_adapters["all"], tmp_path, "same")
    assert adapter_identity(same, config) == adapter_identity(lora_adapters["all"], config)
    other = read_adapter(lora_adapters["mlp"], 16)
    assert adapter_identity(lora_adapters["mlp"], other) != adapter_identity(lora_adapters["all"], config)


def test_registry_refuses_duplicates_unless_in_place(lora_adapters: dict[str, Path]) -> None:
    registry = LoRARegistry(16, 2, [f"a={lora_adapters['all']}"])
    with pytest.raises(ValueError, match="already loaded"):
        registry.load("a", str(lora_adapters["attn"]))
    new, old = registry.load("a", str(lora_adapters["attn"]), inplace=True)
    assert old is not None and new.identity != old.identity and registry.get("a") == new
    with pytest.raises(KeyError):
        registry.unload("nope")


def test_engine_flags(lora_adapters: dict[str, Path], tiny_llama: Path) -> None:
    base = ["--model", str(tiny_llama)]
    cfg = config_from_args([*base, "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                            "--lora-modules", f"a={lora_adapters['all']}", f"b={lora_adapters['attn']}"])
    assert cfg.lora_config() is not None and cfg.lora_config().max_cpu_loras == 2  # type: ignore[union-attr]
    assert len(cfg.lora_modules) == 2 and config_from_args(base).lora_config() is None
    for argv, reason in (
        (["--lora-modules", f"a={lora_adapters['all']}"], "needs --enable-lora"),
        (["--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2"], "must be >= --max-loras"),
        (["--enable-lora", "--max-lora-rank", "2", "--lora-modules", f"a={lora_adapters['all']}"], "above --max-lora-rank"),
        (["--enable-lora", "--lora-modules", "just-a-name"], "name=path"),
    ):
        with pytest.raises(ConfigError, match=reason):
            config_from_args([*base, *argv])
    assert parse_lora_module(" sql = /x ") == ("sql", "/x")
