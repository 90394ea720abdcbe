"""KV cache sizing (how many blocks fit) and allocation (one K and one V tensor per layer)."""

from __future__ import annotations

import psutil
import torch
from evenflow.worker.attention.base import KVCache

# CPU default when kv_cache_memory is not given: this share of the RAM available now, split
# between the ranks that share the machine.
CPU_DEFAULT_RAM_SHARE = 0.25
# CUDA: the cache may grow until this share of total device memory is in use.
CUDA_MEMORY_UTILIZATION = 0.90


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one block costs across all layers, K and V."""
    elem = torch.empty(0, dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem


def cpu_num_blocks(block_bytes: int, kv_cache_memory: int | None, world_size: int) -> int:
    """Blocks that fit in ``kv_cache_memory`` bytes, or in a share of available RAM."""
    budget = kv_cache_memory
    if budget is None:
        budget = int(psutil.virtual_memory().available * CPU_DEFAULT_RAM_SHARE / max(world_size, 1))
    return budget // block_bytes


def cuda_num_blocks(block_bytes: int, device: torch.device) -> int:
    """Blocks that fit in device memory after the weights and the profiling forward's peak."""
    free, total = torch.cuda.mem_get_info(device)
    peak_used = total - free
    peak_alloc = torch.cuda.max_memory_allocated(device)
    current_alloc = torch.cuda.memory_allocated(device)
    # Activations freed after profiling still have to fit next to the cache at run time.
    activation_peak = max(peak_alloc - current_alloc, 0)
    budget = int(total * CUDA_MEMORY_UTILIZATION) - peak_used - activation_peak
    return max(budget, 0) // block_bytes


def allocate_kv_cache(
    num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
    device: torch.device,
) -> list[KVCache]:
    """Per layer (K, V), each [num_blocks, block_size, num_kv_heads, head_dim], zero-filled.

    Zeros, not ``empty``: padded positions of a gathered context are masked out of the softmax but
    still multiplied by zero probabilities, and uninitialized memory could hold NaNs.
    """
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(num_layers)
    ]
