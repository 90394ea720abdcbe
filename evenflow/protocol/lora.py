"""LoRA adapters: the wire's adapter reference, the rules a PEFT folder must follow, its identity.

An adapter is a PEFT folder: ``adapter_config.json`` + ``adapter_model.safetensors``. The
engine-core checks a folder once (``read_adapter``: the config and the safetensors header, no
tensors) and names it on the wire by an ``AdapterRef``; workers load the tensors from the same
folder. The ``identity`` is a digest of the tensor file and of the config fields that change the
math, so it changes whenever the weights do: it keys the prefix cache (evenflow/protocol/block_hash.py
``adapter_extra_keys``) and the workers' adapter caches, never the bare name (a reload under the
same name with new weights must not hit blocks computed with the old ones).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from msgspec import Struct

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# Projections an adapter may target (HF names), and the fused group of the model each one feeds.
TARGET_GROUPS: dict[str, str] = {
    "q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o",
    "gate_proj": "gate_up", "up_proj": "gate_up", "down_proj": "down",
}
# PEFT's tensor names: base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_{A|B}.weight
TENSOR_NAME = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class AdapterRef(Struct, array_like=True, frozen=True):
    """One loaded adapter as the engine-core names it to frontends and workers."""

    name: str
    identity: str  # hex digest of the weights and the scaling config (see the module docstring)
    path: str  # the PEFT folder (absolute), which workers load from
    rank: int = 0


class LoRAConfig(Struct, forbid_unknown_fields=True, frozen=True):
    """vLLM's LoRA knobs, as the workers take them (``--max-loras`` etc.)."""

    max_loras: int = 1  # adapters in one step = slots on each worker
    max_lora_rank: int = 16
    max_cpu_loras: int = 1  # adapters kept in host memory (>= max_loras)


@dataclass(frozen=True)
class AdapterConfig:
    """What an adapter's config says about its math."""

    rank: int
    alpha: float
    use_rslora: bool
    targets: tuple[str, ...]  # HF projection names present in the tensor file
    num_layers: int  # 1 + the highest layer index in the tensor file

    @property
    def scaling(self) -> float:
        """PEFT's: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def parse_lora_module(text: str) -> tuple[str, str]:
    """``name=path`` (vLLM's ``--lora-modules``) -> (name, path); ValueError when malformed."""
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(f"--lora-modules entries are name=path, got {text!r}")
    return name.strip(), path.strip()


def read_safetensors_header(path: Path) -> dict[str, dict]:
    """The tensor table of a safetensors file (name -> dtype, shape, offsets), without the data."""
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path} is not a safetensors file (shorter than its header)")
        (size,) = struct.unpack("<Q", head)
        if size > 100 * 2**20:
            raise ValueError(f"{path} is not a safetensors file (header of {size} bytes)")
        try:
            table = json.loads(f.read(size))
        except ValueError:
            raise ValueError(f"{path} is not a safetensors file (unreadable header)") from None
    table.pop("__metadata__", None)
    return table


def read_adapter(path: str | Path, max_lora_rank: int, num_layers: int | None = None) -> AdapterConfig:
    """Check a PEFT LoRA folder against what evenflow applies; ValueError says what is wrong."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ValueError(f"LoRA adapter path {str(path)!r} is not a folder")
    config_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    for needed in (config_path, weights_path):
        if not needed.is_file():
            raise ValueError(f"LoRA adapter {str(path)!r} has no {needed.name}")
    try:
        raw = json.loads(config_path.read_text())
    except ValueError as e:
        raise ValueError(f"{config_path}: not JSON ({e})") from None
    if not isinstance(raw, dict) or raw.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{config_path}: peft_type must be LORA")
    rank, alpha = raw.get("r"), raw.get("lora_alpha", raw.get("r"))
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise ValueError(f"{config_path}: r must be a positive int and lora_alpha a number")
    if rank > max_lora_rank:
        raise ValueError(f"LoRA adapter {str(path)!r} has rank {rank}, above --max-lora-rank {max_lora_rank}")
    # layers_to_transform needs nothing: the tensor file holds the layers it adapts, the others are zero.
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save"):
        if raw.get(key):
            raise ValueError(f"{config_path}: {key} is not supported")
    if raw.get("use_dora") or raw.get("bias", "none") != "none" or raw.get("fan_in_fan_out"):
        raise ValueError(f"{config_path}: DoRA, LoRA biases and fan_in_fan_out are not supported")
    targets: set[str] = set()
    layers: set[int] = set()
    for name, info in read_safetensors_header(weights_path).items():
        match = TENSOR_NAME.match(name)
        if match is None or match.group(2) not in TARGET_GROUPS:
            raise ValueError(f"LoRA adapter {str(path)!r} has tensor {name!r}: unknown target module "
                             f"(supported: {', '.join(TARGET_GROUPS)})")
        shape = info.get("shape", [])
        if len(shape) != 2 or shape[0 if match.group(3) == "A" else 1] != rank:
            raise ValueError(f"LoRA adapter {str(path)!r}: {name} has shape {shape}, not rank {rank}")
        targets.add(match.group(2))
        layers.add(int(match.group(1)))
    if not targets:
        raise ValueError(f"LoRA adapter {str(path)!r} has no LoRA tensors")
    if num_layers is not None and max(layers) >= num_layers:
        raise ValueError(f"LoRA adapter {str(path)!r} targets layer {max(layers)}; the model has {num_layers}")
    return AdapterConfig(rank, float(alpha), bool(raw.get("use_rslora", False)),
                         tuple(sorted(targets, key=list(TARGET_GROUPS).index)), max(layers) + 1)


def adapter_identity(path: str | Path, config: AdapterConfig) -> str:
    """Digest of the tensor file's bytes and the scaling config (32 hex chars)."""
    digest = hashlib.sha256(f"{config.rank}|{config.alpha!r}|{config.use_rslora}|".encode())
    with (Path(path).expanduser() / WEIGHTS_FILE).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()[:32]


class LoRARequest(Struct, frozen=True):
    """vLLM's offline handle: ``LLM.generate(..., lora_request=LoRARequest("sql", 1, "/path"))``.

    ``lora_int_id`` is accepted for vLLM compatibility; evenflow keys adapters by name and identity.
    """

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""
