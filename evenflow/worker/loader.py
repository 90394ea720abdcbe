"""Weights into a model: from safetensors (lazily, shard by shard), a GGUF file, or random (``dummy``).

Checkpoint tensors are read through ``safe_open`` (memory-mapped) one at a time, and only this
rank's slice of each (``get_slice``), then copied into the preallocated fused parameters, so the
checkpoint is never held twice in RAM. GGUF tensors are dequantized one at a time
(``evenflow.worker.gguf_weights``) and copied the same way.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import torch
from evenflow.protocol.gguf_file import is_gguf_path
from evenflow.worker.gguf_weights import dequantize_raw, iter_gguf_raw_tensors
from evenflow.worker.int4_weights import check_quantization, offer_int4, prepare_int4
from evenflow.worker.models.linear import cpu_has_fast_path
from evenflow.worker.models.llama import LlamaModel
from evenflow.worker.models.weight_specs import WeightSpec
from safetensors import safe_open

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_PROGRESS_MIN_BYTES = 1 << 30  # a progress bar only for checkpoints of 1 GiB or more
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
log = logging.getLogger(__name__)


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


def _shard_slice(tensor_slice, shape: list[int], spec: WeightSpec, rank: int, world_size: int,
                 name: str) -> torch.Tensor:
    """Read only this rank's part of one checkpoint tensor (a safetensors slice or a tensor)."""
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
                    tensor_slice = f.get_slice(name)
                    part = _shard_slice(tensor_slice, tensor_slice.get_shape(), spec, rank, world, name)
                    _copy_part(params[spec.param], spec, part)
                    seen.add(name)
            done_bytes += path.stat().st_size
            if show_progress:
                pct = 100.0 * done_bytes / total_bytes
                print(f"\rloading weights: {pct:5.1f}% ({done_bytes / 2**30:.1f}/{total_bytes / 2**30:.1f} GiB, "
                      f"{time.perf_counter() - t0:.0f}s)", end="", file=sys.stderr, flush=True)
    if show_progress:
        print(file=sys.stderr)
    _check_complete(specs, seen, model_dir)
    model.finish_loading()


def _copy_part(dest: torch.Tensor, spec: WeightSpec, part: torch.Tensor) -> None:
    dest[spec.row_offset : spec.row_offset + part.shape[0]].copy_(part)


def _check_complete(specs: dict[str, WeightSpec], seen: set[str], source: str | Path) -> None:
    missing = sorted(set(specs) - seen)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"checkpoint {source} is missing tensor {missing[0]!r}{more}")


def load_gguf(model: LlamaModel, path: str | Path, quantization: str | None = None) -> None:
    """Fill ``model`` from a GGUF file, each tensor dequantized to the model's dtype on the way, but
    the Q4 projections ``--quantization`` keeps 4-bit (evenflow/worker/int4_weights.py)."""
    int4_params = prepare_int4(model, quantization)
    specs = model.weight_specs()
    params = dict(model.named_parameters())
    dtype = model.embed.dtype
    seen: set[str] = set()
    rank, world = model.tp.rank, model.tp.world_size
    t0 = time.perf_counter()
    with torch.no_grad():
        for raw in iter_gguf_raw_tensors(path, model.cfg):
            name = raw.name
            spec = specs.get(name)
            if spec is None:
                if name == "lm_head.weight" and model.lm_head is None:
                    continue
                raise ValueError(f"unexpected tensor {name!r} in {path} for {model.cfg.architecture}")
            seen.add(name)
            if offer_int4(model, int4_params, spec, raw.qtype, raw.data, raw.shape):
                continue
            tensor = dequantize_raw(raw, dtype)
            _copy_part(params[spec.param], spec, _shard_slice(tensor, list(tensor.shape), spec, rank, world, name))
    _check_complete(specs, seen, path)
    model.finish_loading()
    kept = len(model.int4_param_names())
    log.info("loaded %s in %.1fs (dequantized to %s%s)", path, time.perf_counter() - t0, dtype,
             f"; {kept} projections kept 4-bit" if kept else "")


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


def load_weights(model: LlamaModel, model_dir: str | Path, load_format: str, seed: int,
                 quantization: str | None = None) -> None:
    """Dispatch on ``load_format``: ``auto`` (a GGUF file or a safetensors folder), ``safetensors`` or ``dummy``."""
    if load_format == "auto" and is_gguf_path(model_dir):
        load_gguf(model, model_dir, quantization)
        return
    check_quantization(quantization)
    if quantization == "gguf":
        raise ValueError(f"--quantization gguf keeps a GGUF file's 4-bit weights; {model_dir} is not a .gguf file")
    if load_format in ("auto", "safetensors"):
        load_safetensors(model, model_dir)
    elif load_format == "dummy":
        load_dummy(model, seed)
    else:
        raise ValueError(f"unknown load_format {load_format!r}; choose auto, safetensors or dummy")
