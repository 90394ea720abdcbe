"""KV cache sizing (how many blocks fit) and allocation (one K and one V tensor per layer)."""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

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


GIB = 2**30


@dataclass(frozen=True)
class KVCacheSize:
    """How many blocks a rank's cache holds, and why that many (said in the log)."""

    num_blocks: int
    reason: str


def blocks_usable(max_model_len: int, max_num_seqs: int, block_size: int, lookahead_tokens: int = 0) -> int:
    """The most blocks the scheduler can ever fill: ``max_num_seqs`` requests of ``max_model_len``
    tokens (plus their speculative lookahead) at once. More would never be used."""
    return max_num_seqs * -(-(max_model_len + lookahead_tokens) // block_size)


def cpu_kv_cache_size(block_bytes: int, kv_cache_memory: int | None, world_size: int, usable_blocks: int,
                      available_bytes: int | None = None) -> KVCacheSize:
    """``kv_cache_memory`` bytes when given (refused when more than the RAM available); else what the
    scheduler can use (``blocks_usable``), capped by ``CPU_DEFAULT_RAM_SHARE`` of the available RAM
    split over the ranks (``available_bytes``: measured now, after the weights, when None)."""
    available = psutil.virtual_memory().available if available_bytes is None else available_bytes
    if kv_cache_memory is not None:
        if kv_cache_memory > available:
            raise ValueError(f"--kv-cache-memory {kv_cache_memory / GIB:.2f} GiB is more than the "
                             f"{available / GIB:.2f} GiB of RAM available")
        blocks = kv_cache_memory // block_bytes
        return KVCacheSize(blocks, f"--kv-cache-memory {kv_cache_memory / GIB:.2f} GiB")
    cap_bytes = int(available * CPU_DEFAULT_RAM_SHARE / max(world_size, 1))
    cap = cap_bytes // block_bytes
    usable = f"{usable_blocks * block_bytes / GIB:.2f} GiB is what max_num_seqs x max_model_len can use"
    bound = (f"{CPU_DEFAULT_RAM_SHARE:.0%} of the {available / GIB:.1f} GiB of RAM available"
             + (f" / {world_size} ranks" if world_size > 1 else "") + f" = {cap_bytes / GIB:.2f} GiB")
    if usable_blocks <= cap:
        return KVCacheSize(usable_blocks, f"{usable} (under the cap: {bound}; set --kv-cache-memory to change)")
    return KVCacheSize(cap, f"capped by {bound}; {usable} (set --kv-cache-memory to change)")


@dataclass(frozen=True)
class CudaMemory:
    """Device memory after the weights are loaded and one largest step (forward + sampler) ran."""

    total: int
    used: int  # in use by anything now (weights, CUDA context, other processes), cache emptied
    activation_peak: int  # what the largest step allocated on top of what stays allocated


def measure_cuda_memory(device: torch.device) -> CudaMemory:
    """Read the device after a profiling step that ran since ``torch.cuda.reset_peak_memory_stats``."""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    peak = torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device)
    return CudaMemory(total=total, used=total - free, activation_peak=max(peak, 0))


def cuda_kv_cache_size(block_bytes: int, memory: CudaMemory, kv_cache_memory: int | None,
                       usable_blocks: int) -> KVCacheSize:
    """``cuda_num_blocks``, never more than the scheduler can use (``blocks_usable``), with its reason."""
    fits = cuda_num_blocks(block_bytes, memory, kv_cache_memory)
    if kv_cache_memory is not None:
        return KVCacheSize(fits, f"--kv-cache-memory {kv_cache_memory / GIB:.2f} GiB")
    usable = f"{usable_blocks * block_bytes / GIB:.2f} GiB is what max_num_seqs x max_model_len can use"
    bound = (f"{CUDA_MEMORY_UTILIZATION:.0%} of the device's {memory.total / GIB:.1f} GiB after "
             f"{memory.used / GIB:.2f} GiB in use and {memory.activation_peak / GIB:.2f} GiB of activations")
    if usable_blocks <= fits:
        return KVCacheSize(usable_blocks, f"{usable} (under the cap: {bound})")
    return KVCacheSize(fits, f"capped by {bound}; {usable}")


def cuda_num_blocks(block_bytes: int, memory: CudaMemory, kv_cache_memory: int | None) -> int:
    """Blocks for ``kv_cache_memory`` bytes when given (as vLLM's ``--kv-cache-memory``: it replaces
    the utilization share), else for what fits under ``CUDA_MEMORY_UTILIZATION`` of the device.

    Activations freed after profiling still have to fit next to the cache at run time, so they
    are subtracted either way; a request larger than what is left is refused, not deferred to an
    out-of-memory error in the middle of serving.
    """
    room = memory.total - memory.used - memory.activation_peak
    if kv_cache_memory is None:
        budget = int(memory.total * CUDA_MEMORY_UTILIZATION) - memory.used - memory.activation_peak
        return max(budget, 0) // block_bytes
    if kv_cache_memory > room:
        gib = 2**30
        raise ValueError(f"--kv-cache-memory {kv_cache_memory / gib:.2f} GiB does not fit on the device: "
                         f"{max(room, 0) / gib:.2f} GiB are left after the weights ({memory.used / gib:.2f} GiB in "
                         f"use) and the largest step's activations ({memory.activation_peak / gib:.2f} GiB)")
    return kv_cache_memory // block_bytes


def allocate_kv_cache(
    num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
    device: torch.device,
) -> list[KVCache]:
    """Per layer (K, V), each [num_blocks, block_size, num_kv_heads, head_dim], zero-filled.

    Zeros, not ``empty``: padded positions of a gathered context are masked out of the softmax but
    still multiplied by zero probabilities, and uninitialized memory could hold NaNs. On CPU the zeros
    are the kernel's: each layer's K and V are one anonymous mapping, whose pages read as zero until
    first written, so start-up does not fault in the whole cache. Written with zeros, the default cache
    (a quarter of the RAM: 5.45 GiB on a 24 GiB VM) took 12.6 s of a 26.7 s start-up on a 2-core EPYC,
    where pages fault in at ~1 GB/s; a step now faults in the pages its new K/V land on (a 2048-token
    prompt of SmolLM2 writes 47 MB: by that rate ~50 ms of its ~5 s step there).
    """
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if device.type == "cpu":
        return [_zero_pages(shape, dtype) for _ in range(num_layers)]
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(num_layers)
    ]


def _zero_pages(shape: tuple[int, int, int, int], dtype: torch.dtype) -> KVCache:
    """K and V of ``shape`` in one private anonymous mapping (zero pages until written; the tensors keep it)."""
    numel = math.prod(shape)
    if numel == 0:  # a mapping cannot be empty
        return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    nbytes = 2 * numel * dtype.itemsize
    both = torch.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=dtype)
    return both[:numel].view(shape), both[numel : 2 * numel].view(shape)
