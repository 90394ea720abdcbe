"""Tensor-parallel plumbing: one process group, and the three collectives the model needs.

Every rank holds 1/N of the attention heads, of the MLP columns (gate/up) and rows (down), and of
the vocabulary (embedding rows and LM-head rows). Row-parallel outputs are summed with all-reduce,
the vocabulary-sharded logits are all-gathered, and rank 0 broadcasts the ids it sampled so every
rank appends the same token to its own copy of each request's token list (sampling once and
broadcasting is cheaper and safer than keeping N samplers' random streams in lockstep).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in the tensor-parallel group (world_size 1: every collective is a no-op)."""

    rank: int = 0
    world_size: int = 1

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def shard_range(self, total: int) -> tuple[int, int]:
        """[start, end) of this rank's equal share of ``total`` (which must divide evenly)."""
        if total % self.world_size:
            raise ValueError(f"{total} does not split evenly over tensor_parallel_size={self.world_size}")
        size = total // self.world_size
        return self.rank * size, (self.rank + 1) * size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over ranks in place (row-parallel outputs, vocab-parallel embeddings)."""
        if self.enabled:
            dist.all_reduce(x)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` along its last dimension (vocab-sharded logits)."""
        if not self.enabled:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def broadcast_from_rank0(self, x: torch.Tensor) -> torch.Tensor:
        """Give every rank rank 0's ``x`` (same shape and dtype everywhere), in place."""
        if self.enabled:
            dist.broadcast(x, src=0)
        return x


def init_tensor_parallel(rank: int, world_size: int, init_addr: str, device: torch.device) -> TensorParallel:
    """Join the process group at ``init_addr`` (``tcp://127.0.0.1:PORT``); gloo on CPU, NCCL on CUDA."""
    if world_size <= 1:
        return TensorParallel()
    if not init_addr:
        raise ValueError("tensor parallel needs dist_init_addr (tcp://127.0.0.1:PORT)")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_addr, rank=rank, world_size=world_size)
    return TensorParallel(rank=rank, world_size=world_size)


def destroy_tensor_parallel() -> None:
    """Leave the process group, if this process joined one."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
