"""The LM head's greedy screen after its 4-bit product, as one C++ pass a row (greedy_screen.cpp says what it
computes; models/lm_head.py why). Where the library does not build, ``ScreenedHead`` keeps its PyTorch ops."""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch
from evenflow.worker.cpp_kernels import load_cpp

SOURCE = Path(__file__).with_name("greedy_screen.cpp")


def _bind(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.greedy_screen.restype = ctypes.c_int
    lib.greedy_screen.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, ctypes.c_float, ptr, i64, ctypes.c_int]


class GreedyScreen:
    """``__call__(screen, x, table, row_error, sigmas)``: float32 logits [rows, vocab] whose argmax is float32's."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._run = lib.greedy_screen

    def __call__(self, screen: torch.Tensor, x: torch.Tensor, table: torch.Tensor, row_error: torch.Tensor,
                 sigmas: float) -> torch.Tensor:
        """``screen`` [rows, >= vocab] bfloat16 (the 4-bit product), ``x`` [rows, hidden] float32, ``table``
        [vocab, hidden] float32, ``row_error`` [vocab] (or [1, vocab]) float32."""
        vocab, hidden = table.shape
        x = x.float().contiguous()
        table, row_error = table.float().contiguous(), row_error.float().contiguous()  # the head's own: no copy
        # The C++ reads raw pointers: every shape is checked here, not by asserts ``python -O`` drops.
        if not (screen.dtype == torch.bfloat16 and screen.dim() == 2 and screen.stride(1) == 1
                and screen.shape[0] == x.shape[0] and screen.shape[1] >= vocab and x.shape[1] == hidden
                and row_error.numel() == vocab and all(t.device.type == "cpu" for t in (screen, x, table))):
            raise ValueError(f"greedy screen: screen {tuple(screen.shape)} {screen.dtype}, x {tuple(x.shape)}, "
                             f"table {tuple(table.shape)}, row_error {tuple(row_error.shape)}")
        out = torch.empty(x.shape[0], vocab, dtype=torch.float32)
        self._run(screen.data_ptr(), screen.stride(0), x.shape[0], vocab, x.data_ptr(), hidden, table.data_ptr(),
                  row_error.data_ptr(), sigmas, out.data_ptr(), out.stride(0), torch.get_num_threads())
        return out


@cache
def load_greedy_screen() -> GreedyScreen | None:
    """The C++ pass, once per process (None: it did not build; the log says why)."""
    lib = load_cpp(SOURCE, "the LM head's greedy screen", _bind)
    return None if lib is None else GreedyScreen(lib)
