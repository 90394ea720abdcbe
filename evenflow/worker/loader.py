"""Weights into a model: from safetensors (lazily, shard by shard) or random (``dummy``).

Checkpoint tensors are read through ``safe_open`` (memory-mapped) one at a time, and only this
rank's slice of each (``get_slice``), then copied into the preallocated fused parameters, so the
checkpoint is never held twice in RAM.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from evenflow.worker.models.linear import cpu_has_fast_path
from evenflow.worker.models.llama import LlamaModel, WeightSpec
from safetensors import safe_open

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_PROGRESS_MIN_BYTES = 1 << 30  # a progress bar only for checkpoints of 1 GiB or more
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def resolve_dtype(requested: str, checkpoint_dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` = the checkpoint's dtype, or float32 where the device has no fast path for it."""
    if requested != "auto":
        if requested not in DTYPES:
            raise ValueError(f"unknown dtype {requested!r}; choose auto, {', '.join(DTYPES)}")
        return DTYPES[requested]
    dtype = DTYPES.get(checkpoint_dtype, torch.float32)
    if device.type == "cpu" and not cpu_has_fast_path(dtype):
        return torch.float32
    return dtype


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the index's shards, or the single file."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return files


def _shard_slice(tensor_slice, spec: WeightSpec, rank: int, world_size: int, name: str) -> torch.Tensor:
    """Read only this rank's part of one checkpoint tensor."""
    shape = tensor_slice.get_shape()
    if spec.shard_dim is None or world_size == 1:
        return tensor_slice[:]
    total = shape[spec.shard_dim]
    size = -(-total // world_size)  # vocab rows may not divide evenly; the padding rows stay zero
    start, end = rank * size, min((rank + 1) * size, total)
    if spec.shard_dim == 0:
        return tensor_slice[start:end]
    if len(shape) != 2:
        raise ValueError(f"cannot shard {name} of shape {shape} along dim 1")
    return tensor_slice[:, start:end]


def load_safetensors(model: LlamaModel, model_dir: str | Path) -> None:
    """Fill ``model`` from the checkpoint in ``model_dir``; raise naming any missing tensor."""
    model_dir = Path(model_dir)
    specs = model.weight_specs()
    params = dict(model.named_parameters())
    files = checkpoint_files(model_dir)
    total_bytes = sum(f.stat().st_size for f in files)
    show_progress = total_bytes >= _PROGRESS_MIN_BYTES
    seen: set[str] = set()
    done_bytes, t0 = 0, time.perf_counter()
    rank, world = model.tp.rank, model.tp.world_size
    with torch.no_grad():
        for path in files:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    spec = specs.get(name)
                    if spec is None:
                        if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and model.lm_head is None):
                            continue
                        raise ValueError(f"unexpected tensor {name!r} in {path.name} for {model.cfg.architecture}")
                    part = _shard_slice(f.get_slice(name), spec, rank, world, name)
                    dest = params[spec.param]
                    rows = part.shape[0]
                    dest[spec.row_offset : spec.row_offset + rows].copy_(part)
                    seen.add(name)
            done_bytes += path.stat().st_size
            if show_progress:
                pct = 100.0 * done_bytes / total_bytes
                print(f"\rloading weights: {pct:5.1f}% ({done_bytes / 2**30:.1f}/{total_bytes / 2**30:.1f} GiB, "
                      f"{time.perf_counter() - t0:.0f}s)", end="", file=sys.stderr, flush=True)
    if show_progress:
        print(file=sys.stderr)
    missing = sorted(set(specs) - seen)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"checkpoint {model_dir} is missing tensor {missing[0]!r}{more}")
    model.finish_loading()


def load_dummy(model: LlamaModel, seed: int) -> None:
    """Random weights from the config alone (benchmarks of big shapes without a checkpoint)."""
    gen = torch.Generator(device="cpu").manual_seed(seed + 1000 * model.tp.rank)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm"):
                p.fill_(1.0)
            else:
                p.copy_(torch.empty(p.shape, dtype=torch.float32).normal_(0.0, 0.02, generator=gen))
    model.finish_loading()


def load_weights(model: LlamaModel, model_dir: str | Path, load_format: str, seed: int) -> None:
    """Dispatch on ``load_format``: ``auto``/``safetensors`` or ``dummy``."""
    if load_format in ("auto", "safetensors"):
        load_safetensors(model, model_dir)
    elif load_format == "dummy":
        load_dummy(model, seed)
    else:
        raise ValueError(f"unknown load_format {load_format!r}; choose auto, safetensors or dummy")
