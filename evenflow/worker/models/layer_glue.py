"""The elementwise work between a layer's projections for steps of few rows: one C++ call per group.

On the narrowing path (a float32 residual stream into bfloat16 int4 projections, models/int4_linear.py) a
layer runs, between its projections, the residual add with RMSNorm (twice), the rotary embedding of q
and k with its cast to the KV cache's dtype, and SwiGLU. Eager, that is ~20 small ATen ops a layer, and at
one decode row each costs its dispatch, not its math. Inductor fuses them for steps of many rows
(models/compiled_ops.py), but a compiled call costs ~40 us beyond an eager one: a loss below a few hundred
rows. ``LayerGlue`` runs each group as one call of a C++ loop (layer_glue.cpp; the same float32 math and
one rounding at the end, as inductor's fused graphs) for the steps the compiled graphs do not take: 6-8 us
a call at one row against 9-19 us for a group's eager ops. On a 2-core Xeon with AMX a one-row decode step
of SmolLM2's GGUF took 0.89x its eager time, an 8-request one 0.89x (``scripts/bench_decode_ab.py``;
docs/results/quantization.md).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from evenflow.worker.cpp_kernels import load_cpp
from evenflow.worker.models.compiled_ops import off_narrowing_path
from evenflow.worker.models.int4_linear import Int4CpuLinear
from evenflow.worker.models.linear import Linear
from evenflow.worker.models.q4_blocks import Int4Weight

if TYPE_CHECKING:
    from evenflow.worker.models.llama import LlamaModel

SOURCE = Path(__file__).with_name("layer_glue.cpp")


def _bind(lib: ctypes.CDLL) -> None:
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.glue_add_norm.argtypes = [ptr, i64, ptr, i64, ptr, ctypes.c_float, ptr, i64, i64, i32]
    lib.glue_rotary.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i32]
    lib.glue_swiglu.argtypes = [ptr, i64, ptr, i64, i64, i32]
    for fn in (lib.glue_add_norm, lib.glue_rotary, lib.glue_swiglu):
        fn.restype = None


class LayerGlue:
    """``add_norm``, ``rotary_qk`` and ``swiglu`` as ``CompiledOps`` has them, for one model's widths, on
    bfloat16 activations and KV cache beside a float32 residual stream (``build``: None where the kernel
    does not build). Qwen3's per-head q/k norm keeps its rotary eager (models/llama.py)."""

    def __init__(self, lib: ctypes.CDLL, qk_heads: int, head_dim: int, inter: int) -> None:
        self._lib = lib
        self._qk_heads, self._head_dim, self._inter = qk_heads, head_dim, inter

    @classmethod
    def build(cls, qk_heads: int, head_dim: int, inter: int) -> LayerGlue | None:
        lib = load_cpp(SOURCE, "layer elementwise ops of few-row steps", _bind)
        return None if lib is None else cls(lib, qk_heads, head_dim, inter)

    @staticmethod
    def takes(linear: Linear | Int4CpuLinear, rows: int) -> bool:
        """Whether a step of ``rows`` rows computes every projection in bfloat16 under ``linear``, the model's
        kernel as it is now (``attach_layer_glue`` checked that every projection is 4-bit, so its plan says)."""
        return isinstance(linear, Int4CpuLinear) and linear.plan.act_dtype(rows) == torch.bfloat16

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor, scaled: torch.Tensor, eps_root: torch.Tensor
                 ) -> torch.Tensor:
        """``x += delta`` in place (float32 ``x``, bfloat16 ``delta``), then RMSNorm of ``x`` in bfloat16:
        ``x * scaled / hypot(|x|, eps_root)`` (rms_norm_narrowing)."""
        rows, h = x.shape
        assert x.dtype == torch.float32 and delta.dtype == torch.bfloat16 and x.stride(1) == delta.stride(1) == 1
        assert delta.shape == x.shape and scaled.dtype == torch.float32 and scaled.is_contiguous()
        assert scaled.numel() == h
        out = torch.empty(rows, h, dtype=torch.bfloat16)
        self._lib.glue_add_norm(x.data_ptr(), x.stride(0), delta.data_ptr(), delta.stride(0), scaled.data_ptr(),
                                float(eps_root), out.data_ptr(), rows, h, torch.get_num_threads())
        return out

    def rotary_qk(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The q and k heads of a bfloat16 fused qkv output rotated (``RotaryTable.lookup``'s float32
        tables), in bfloat16: [rows, q and k heads, head_dim]."""
        rows, d = qkv.shape[0], self._head_dim
        assert qkv.dtype == torch.bfloat16 and qkv.stride(1) == 1 and qkv.shape[1] >= self._qk_heads * d
        assert cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
        assert cos.shape[0] == sin.shape[0] == rows and cos.shape[-1] == sin.shape[-1] == d
        out = torch.empty(rows, self._qk_heads, d, dtype=torch.bfloat16)
        self._lib.glue_rotary(qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), rows,
                              self._qk_heads, d, torch.get_num_threads())
        return out

    def swiglu(self, gu: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a bfloat16 fused gate_up output, in bfloat16."""
        rows, inter = gu.shape[0], self._inter
        assert gu.dtype == torch.bfloat16 and gu.stride(1) == 1 and gu.shape[1] == 2 * inter
        out = torch.empty(rows, inter, dtype=torch.bfloat16)
        self._lib.glue_swiglu(gu.data_ptr(), gu.stride(0), out.data_ptr(), rows, inter, torch.get_num_threads())
        return out


def attach_layer_glue(model: LlamaModel) -> str:
    """Give ``model`` the C++ groups where it runs the narrowing path with a bfloat16 KV cache (GGUF 4-bit
    weights on a CPU with native bfloat16); returns what was done, for the start-up log."""
    off = off_narrowing_path(model)
    if off is not None:
        return f"eager ({off})"
    if model.kv_dtype != torch.bfloat16:
        return "eager (the KV cache is float32: decode steps compute in float32)"
    if any(type(p) is not Int4Weight for w in model._linears for p in (w.qkv, w.o, w.gate_up, w.down)):
        return "eager (some projections are dense, and compute in float32)"
    if any(w.qkv_bias is not None for w in model._linears):  # a float32 bias widens the qkv output
        return "eager (the qkv projection has a bias)"
    glue = LayerGlue.build(model.num_heads + model.num_kv_heads, model.cfg.head_dim, model.intermediate)
    if glue is None:
        return "eager (the C++ kernel did not build)"
    model.layer_glue = glue
    return "C++ groups for the bfloat16 steps the compiled graphs do not take"
