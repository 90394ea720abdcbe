"""Every layer of a few-row decode step in one C++ call, where the layer glue and the decode kernel run.

With the layer glue (layer_glue.py) and the decode-attention kernel (attention/cpu_decode.py), a layer of a
one-row step on the narrowing path is eleven calls from Python: the add-norm, four projections, the rotary,
two K/V writes, the attention, the second add-norm and SwiGLU. At one row each call costs more in the
interpreter and the dispatcher than in its loop. ``FusedDecode`` runs the whole layer loop in C++
(fused_decode.cpp, compiled with the glue's, the attention kernel's and the int4 GEMV's sources in one
library): the same loops and the same projection kernels (evenflow's int4 GEMV, torch's int4 kernel through
ATen's dispatcher, or oneDNN's linear on the dense copy, as the plan picks them for the step's rows), so a
step's layers give the same bits as the Python loop with the glue.

It takes a step when the glue would take it (every projection computes in bfloat16 at its row count), the
step is decodes alone, all attended by the kernel (no prompt chunks, no LoRA, no layer groups), and its
rows run on the int4 kernel or, up to ``EXACT_ROWS``, on dense copies the model keeps.
"""

from __future__ import annotations

import ctypes
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from evenflow.worker.attention.cpu_decode import SOURCE as ATTENTION_SOURCE
from evenflow.worker.attention.torch_paged import TorchAttentionPlan
from evenflow.worker.cpp_kernels import load_cpp_sources
from evenflow.worker.models.int4_gemv import SOURCES as GEMV_SOURCES
from evenflow.worker.models.int4_linear import Int4CpuLinear, packed_copy
from evenflow.worker.models.layer_glue import SOURCE as GLUE_SOURCE
from evenflow.worker.models.layer_glue import LayerGlue
from evenflow.worker.models.q4_blocks import GROUP, pack_tile_rows
from evenflow.worker.models.row_tiles import EXACT_ROWS

if TYPE_CHECKING:
    from evenflow.worker.attention.base import KVCache
    from evenflow.worker.models.linear import Linear
    from evenflow.worker.models.llama import LlamaModel

_SOURCES = [GLUE_SOURCE, ATTENTION_SOURCE, *GEMV_SOURCES, Path(__file__).with_name("fused_decode.cpp")]
_KERNELS = {"int4": 0, "dense": 1, "gemv": 2}  # fused_decode.cpp's Kernel


def _bind(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.fused_decode_step.restype = ctypes.c_int
    lib.fused_decode_step.argtypes = [i64, ptr, ptr, ptr, ptr, ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64,
                                      ctypes.c_float, ctypes.c_int, ctypes.c_int]
    lib.fused_decode_error.restype = ctypes.c_char_p


def _ops_registered() -> bool:
    """Whether this process already has the library's registration op (from a load ``build`` did not make)."""
    try:
        torch.ops.evenflow_fused_decode.register_model  # noqa: B018 (the lookup is the check)
    except (AttributeError, RuntimeError):
        return False
    return True


class FusedDecode:
    """The layer loop of one model's decode steps as one C++ call (``build``: None where it does not build)."""

    _loaded_here = False  # whether this module's build loaded the library (and registered its ops)

    def __init__(self, lib: ctypes.CDLL, model: LlamaModel) -> None:
        self._step, self._error = lib.fused_decode_step, lib.fused_decode_error
        self.num_layers = len(model._linears)
        projections = [p for w in model._linears for p in (w.qkv, w.o, w.gate_up, w.down)]
        self.dense_copies = all(packed_copy(p, torch.bfloat16) for p in projections)
        none = torch.empty(0, dtype=torch.bfloat16)
        weights = [t for p in projections for t in (p.packed, p.scale_zeros, none if p.strip_scales is None else
                                                    p.strip_scales, p.dense if self.dense_copies else none)]
        norms = [n for pair in model._scaled_norms for n in pair]
        assert all(t.is_contiguous() for t in weights + norms)
        cfg = model.cfg
        shape = [cfg.hidden_size, model.num_heads, model.num_kv_heads, cfg.head_dim, model.intermediate, GROUP,
                 pack_tile_rows()]
        ops = torch.ops.evenflow_fused_decode
        self._handle = ops.register_model(weights, norms, shape, float(model._eps_root))
        # The library holds the weights: they go when this object does (not at interpreter exit, ops gone).
        weakref.finalize(self, ops.release_model, self._handle).atexit = False

    @classmethod
    def build(cls, model: LlamaModel) -> FusedDecode | None:
        if not cls._loaded_here and _ops_registered():  # another copy's ops would not reach this copy's models
            return None
        lib = load_cpp_sources(_SOURCES, "the layers of few-row decode steps", _bind)
        if lib is None:
            return None
        cls._loaded_here = True
        return cls(lib, model)

    def takes(self, plan: object, rows: int, glue: LayerGlue | None, linear: Linear | Int4CpuLinear) -> bool:
        """Whether a step of ``rows`` rows under attention ``plan`` is decodes alone, all by the C++ kernel,
        with ``glue`` as its elementwise path (every projection in bfloat16 under ``linear``, the model's
        kernel), on the int4 kernel or on dense copies this model keeps."""
        if not (isinstance(glue, LayerGlue) and isinstance(plan, TorchAttentionPlan) and not plan.chunks
                and not plan.decode_groups and plan.kernel_decodes is not None and plan.kernel_decodes.num == rows):
            return False
        assert isinstance(linear, Int4CpuLinear)  # the glue takes no other kernel's steps
        return linear.plan.takes_int4(rows) or (self.dense_copies and rows <= EXACT_ROWS)

    def __call__(self, x: torch.Tensor, h0: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 kv_caches: list[KVCache], plan: TorchAttentionPlan, scale: float, linear: Int4CpuLinear) -> None:
        """Every layer of a step ``takes`` accepted: ``x`` (the float32 residual stream, [rows, hidden]) is
        left as the last layer's output; ``h0`` is layer 0's normed input in bfloat16; the projections run
        on the kernel ``linear``'s plan gives the step's rows."""
        rows, kd = x.shape[0], plan.kernel_decodes
        assert kd is not None and x.dtype == torch.float32 and x.is_contiguous()
        assert h0.dtype == torch.bfloat16 and h0.is_contiguous() and h0.shape == x.shape
        assert cos.is_contiguous() and sin.is_contiguous() and cos.dtype == sin.dtype == torch.float32
        slots = plan.slot_mapping
        assert slots.dtype == torch.int64 and slots.is_contiguous() and slots.shape[0] == rows
        k0 = kv_caches[0][0]
        assert k0.dtype == torch.bfloat16 and k0.is_contiguous() and len(kv_caches) == self.num_layers
        kv_ptrs = (ctypes.c_int64 * (2 * self.num_layers))(*(c.data_ptr() for kv in kv_caches for c in kv))
        rc = self._step(self._handle, x.data_ptr(), h0.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
                        k0.shape[0] * k0.shape[1], kd.block_table.data_ptr(), kd.block_table.stride(0),
                        kd.seq_lens.data_ptr(), kv_ptrs, len(kv_ptrs), k0.shape[1], rows, scale,
                        torch.get_num_threads(), _KERNELS[linear.kernel(rows)])
        if rc:
            raise RuntimeError(self._error().decode(errors="replace"))


def attach_fused_decode(model: LlamaModel, attn: object) -> str:
    """Give ``model`` the fused layer loop where its decode steps take the layer glue and ``attn`` (the step's
    attention backend) decodes by the C++ kernel; returns what was done, for the start-up log."""
    if model.layer_glue is None:
        return "off (no layer glue)"
    if model.cfg.qk_norm:
        return "off (Qwen3's per-head q/k norm stays PyTorch's)"
    kernel = getattr(attn, "decode_kernel", None)
    if kernel is None or not kernel.available:
        return "off (decode attention is not the C++ kernel)"
    model.fused_decode = fused = FusedDecode.build(model)
    if fused is None:
        return "off (the C++ library did not build)"
    copies = f"and up to {EXACT_ROWS} on their dense copies" if fused.dense_copies else "(no dense copies kept)"
    return f"one C++ call a step, for the rows the int4 kernel takes {copies}"
