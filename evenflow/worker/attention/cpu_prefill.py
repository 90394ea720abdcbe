"""Prefill attention over a bfloat16 paged KV cache on CPUs with AMX: a C++ kernel (paged_prefill.cpp and its
tile programs, prefill_tiles.cpp).

Every chunk of a step with PREFILL_KERNEL_MIN_ROWS new tokens or more (a whole prompt, a chunk after its cached
context, a prefix hit's remainder) attends causally to its keys, read from the cache after the
step's K/V are written, in one call per layer. PyTorch's fused CPU attention, the path elsewhere, runs the
2048-token prompt of SmolLM2-135M (9 query heads over 3 KV heads of 64) at ~425 GFLOPS on a 2-core Xeon with
AMX, 46% of the prompt's step; its softmax, not its products, is the cost. The kernel's products are AMX
tiles and its softmax stays in registers a row at a time: 0.39-0.52x PyTorch's time a layer on 64-2048-token
chunks and at 8,192 keys, a lone 2048-token prompt's step 0.69x (``scripts/probe_prefill_attention.py`` prints
the tables; docs/results/quantization.md).

It is compiled once per machine (evenflow/worker/cpp_kernels.py) and called through ctypes. Without AMX or a
compiler, or for shapes it does not serve (head_dim other than 64 or 128, blocks not a multiple of 16 tokens,
a float32 cache: the exact reference path), chunks keep PyTorch's attention.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch
from evenflow.worker.cpp_kernels import AMX_TILES_SOURCE, load_cpp_sources

HEAD_DIMS = (64, 128)
# Chunks of fewer rows (a speculative check, a prompt's last few tokens) keep PyTorch's attention: the kernel
# packs the chunk's whole context first, and at 6 rows over 2,048 keys that took as long as PyTorch's two calls.
PREFILL_KERNEL_MIN_ROWS = 8
SOURCES = [AMX_TILES_SOURCE, *(Path(__file__).with_name(name) for name in ("prefill_tiles.cpp", "paged_prefill.cpp"))]

log = logging.getLogger("evenflow.worker.attention.cpu_prefill")


def _bind(lib: ctypes.CDLL) -> None:
    fn = lib.evenflow_paged_prefill_bf16
    fn.restype = ctypes.c_int
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, i64, ptr, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
    lib.evenflow_paged_prefill_supported.restype = ctypes.c_int


@functools.cache
def _load() -> ctypes.CDLL | None:
    """The library where the CPU runs it (AMX, AVX-512 BF16, the process granted the tile state), else None."""
    lib = load_cpp_sources(SOURCES, "prefill attention on the bfloat16 KV cache", _bind)
    if lib is not None and not lib.evenflow_paged_prefill_supported():
        log.info("prefill attention on the bfloat16 KV cache stays PyTorch's: this CPU (or kernel) has no AMX tiles")
        return None
    return lib


class PagedPrefillKernel:
    """The kernel for one model's heads, where it serves them (``available``)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype,
                 device: torch.device) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        serves = (device.type == "cpu" and kv_dtype == torch.bfloat16 and head_dim in HEAD_DIMS
                  and num_heads % num_kv_heads == 0)
        lib = _load() if serves else None
        self._fn = lib.evenflow_paged_prefill_bf16 if lib is not None else None

    @property
    def available(self) -> bool:
        return self._fn is not None

    @staticmethod
    def chunk_table(chunks: list[tuple[int, int, int, int]]) -> torch.Tensor:
        """The chunks as the kernel reads them, from (first row in q, rows, keys, block table row) each: a
        chunk's keys are its context, its own tokens included."""
        return torch.tensor(chunks, dtype=torch.int64).view(-1, 4)

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 chunks: torch.Tensor, out: torch.Tensor, scale: float) -> None:
        """``out``'s chunk rows = their attention: ``q`` [T, heads, D] (rows may be strided), caches [blocks,
        block_size, kv_heads, D] holding the chunks' own K/V already, ``block_table`` [R, >= blocks] int32,
        ``chunks`` from ``chunk_table``, ``out`` [T, heads * D] (rows may be strided), bfloat16 but the tables."""
        assert self._fn is not None and out.stride(1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
        assert q.dtype == k_cache.dtype == v_cache.dtype == out.dtype == torch.bfloat16
        assert block_table.dtype == torch.int32 and block_table.stride(1) == 1
        assert chunks.dtype == torch.int64 and chunks.is_contiguous()
        if q.stride(2) != 1 or q.stride(1) != self.head_dim:
            q = q.contiguous()
        rc = self._fn(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_table.data_ptr(),
                      block_table.stride(0), chunks.data_ptr(), chunks.shape[0], out.data_ptr(), out.stride(0),
                      self.num_heads, self.num_kv_heads, self.head_dim, k_cache.shape[1], scale,
                      torch.get_num_threads())
        if rc:
            raise ValueError(f"paged prefill kernel: {self.num_heads} heads over {self.num_kv_heads} KV heads of "
                             f"{self.head_dim}, blocks of {k_cache.shape[1]}, not served (code {rc})")
