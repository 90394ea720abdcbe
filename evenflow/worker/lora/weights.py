"""One adapter's tensors in host memory, laid out for the slot pool and sharded for this rank.

Per projection and layer: ``a_t`` = lora_A transposed, [in_local, r], and ``b_t`` = lora_B
transposed and multiplied by the adapter's scaling, [r, out_local]. Tensor parallel splits them as
the base weights are split (evenflow/worker/models/weight_specs.py): a column-parallel
projection (q/k/v/gate/up) keeps all of A and its rows of B; a row-parallel one (o/down) keeps its
columns of A and all of B, so each rank's partial delta is summed by the all-reduce the base output
already goes through.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from evenflow.protocol.lora import TENSOR_NAME, WEIGHTS_FILE, AdapterConfig, AdapterRef, read_adapter
from evenflow.worker.parallel import TensorParallel

ROW_PARALLEL = frozenset(("o_proj", "down_proj"))


@dataclass(frozen=True)
class ProjectionShape:
    """A target projection's full (unsharded) input and output sizes."""

    in_features: int
    out_features: int


@dataclass
class HostAdapter:
    """An adapter ready to be copied into a slot: (a_t, b_t) per (projection, layer)."""

    ref: AdapterRef
    config: AdapterConfig
    tensors: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]]


def shard(tensor: torch.Tensor, dim: int, tp: TensorParallel) -> torch.Tensor:
    start, end = tp.shard_range(tensor.shape[dim])
    return tensor.narrow(dim, start, end - start)


def load_host_adapter(ref: AdapterRef, shapes: dict[str, ProjectionShape], num_layers: int, max_rank: int,
                      tp: TensorParallel, dtype: torch.dtype) -> HostAdapter:
    """Read and check the adapter folder, then keep this rank's share of each tensor."""
    config = read_adapter(ref.path, max_rank, num_layers)
    raw = load_file(str(Path(ref.path).expanduser() / WEIGHTS_FILE))
    pairs: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    for name, tensor in raw.items():
        match = TENSOR_NAME.match(name)
        assert match is not None  # read_adapter checked every name
        pairs.setdefault((match.group(2), int(match.group(1))), {})[match.group(3)] = tensor
    tensors = {}
    for (proj, layer), pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {ref.path!r}: layer {layer} {proj} lacks lora_A or lora_B")
        a, b = pair["A"].float(), pair["B"].float()  # [r, in], [out, r]
        shape = shapes[proj]
        if a.shape[1] != shape.in_features or b.shape[0] != shape.out_features:
            raise ValueError(f"LoRA adapter {ref.path!r}: layer {layer} {proj} is {tuple(b.shape[:1])}x"
                             f"{tuple(a.shape[1:])}, the model's is {shape.out_features}x{shape.in_features}")
        if proj in ROW_PARALLEL:
            a = shard(a, 1, tp)
        else:
            b = shard(b, 0, tp)
        tensors[(proj, layer)] = (a.t().contiguous().to(dtype), (b.t() * config.scaling).contiguous().to(dtype))
    return HostAdapter(ref, config, tensors)
