"""Decode attention over a bfloat16 paged KV cache on CPU: a small C++ kernel (paged_decode.cpp).

A decode step's attention is one query token per request against its cached context. PyTorch's fused
CPU attention is built for many query rows: for a decode it packs K/V for its matrix kernels on every
call, and the step gathers each request's blocks into one tensor first. The kernel reads K and V once, in
place from their blocks, with float32 math (the scores' softmax with PyTorch's own vectorized exp). On a
2-core Xeon with AMX, SmolLM2-135M's shapes (9 query heads over 3 KV heads, head_dim 64), per layer:
``scripts/probe_decode_attention.py`` prints the table (docs/results/quantization.md).

It is compiled once per machine (evenflow/worker/cpp_kernels.py) and called through ctypes. Without a
compiler, or for shapes it does not serve (head_dim other than 64 or 128, a float32 cache: the exact
reference path), decodes keep PyTorch's attention.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from evenflow.worker.cpp_kernels import load_cpp

HEAD_DIMS = (64, 128)
SOURCE = Path(__file__).with_name("paged_decode.cpp")


def _bind(lib: ctypes.CDLL) -> None:
    fn = lib.paged_decode_bf16
    fn.restype = ctypes.c_int
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
    lib.paged_decode_max_group.restype = ctypes.c_int


def _load() -> ctypes.CDLL | None:
    return load_cpp(SOURCE, "decode attention on the bfloat16 KV cache", _bind)


class PagedDecodeKernel:
    """The kernel for one model's heads, where it serves them (``available``)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype,
                 device: torch.device) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        group = num_heads // num_kv_heads
        serves = (device.type == "cpu" and kv_dtype == torch.bfloat16 and head_dim in HEAD_DIMS
                  and num_heads % num_kv_heads == 0)
        lib = _load() if serves else None
        self._fn = lib.paged_decode_bf16 if lib is not None and group <= lib.paged_decode_max_group() else None

    @property
    def available(self) -> bool:
        return self._fn is not None

    @staticmethod
    def check_tables(block_table: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """The step's tables as ``__call__`` reads them (once a step: every layer reads the same ones)."""
        assert block_table.dtype == torch.int32 and block_table.stride(1) == 1
        assert seq_lens.dtype == torch.int32 and seq_lens.is_contiguous()

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, out: torch.Tensor, scale: float) -> None:
        """``out[r]`` = request r's attention: ``q`` [R, heads, D] (rows may be strided),
        caches [blocks, block_size, kv_heads, D], ``block_table`` [R, >= its blocks] int32 and ``seq_lens``
        [R] int32 (its context, the new token's K/V already written; both as ``check_tables`` wants them),
        ``out`` [R, heads * D] (rows may be strided), all bfloat16 but the int32 tables."""
        assert self._fn is not None and out.stride(1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
        assert q.dtype == k_cache.dtype == v_cache.dtype == out.dtype == torch.bfloat16
        if q.stride(2) != 1 or q.stride(1) != self.head_dim:
            q = q.contiguous()
        rc = self._fn(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_table.data_ptr(),
                      block_table.stride(0), seq_lens.data_ptr(), out.data_ptr(), out.stride(0), q.shape[0],
                      self.num_heads, self.num_kv_heads, self.head_dim, k_cache.shape[1], scale,
                      torch.get_num_threads())
        if rc:
            raise ValueError(f"paged decode kernel: {self.num_heads} heads over {self.num_kv_heads} KV heads of "
                             f"{self.head_dim} not served (code {rc})")
