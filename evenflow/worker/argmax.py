"""Each row's argmax of float32 logits on the CPU, the answer ``torch.argmax(dim=-1)`` gives, in C++ (argmax.cpp
says why): the sampler's greedy rows and its exponential race. Where the library does not build, or the
tensor is not a CPU float32 one with unit column stride, ``torch.argmax`` serves."""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch
from evenflow.worker.cpp_kernels import load_cpp

SOURCE = Path(__file__).with_name("argmax.cpp")


def _bind(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.evenflow_row_argmax.restype = ctypes.c_int
    lib.evenflow_row_argmax.argtypes = [ptr, i64, i64, i64, ptr, ctypes.c_int]


@cache
def _library() -> ctypes.CDLL | None:
    return load_cpp(SOURCE, "the sampler's row argmax", _bind)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a 2-D tensor, as int64 [rows]."""
    lib = _library()
    rows, n = x.shape
    if (lib is None or x.dtype != torch.float32 or x.device.type != "cpu" or n == 0 or rows == 0
            or x.stride(1) != 1):
        return x.argmax(dim=-1)
    out = torch.empty(rows, dtype=torch.int64)
    lib.evenflow_row_argmax(x.data_ptr(), rows, n, x.stride(0), out.data_ptr(), torch.get_num_threads())
    return out
