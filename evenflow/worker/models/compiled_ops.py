"""The elementwise work between a layer's projections, compiled by inductor for many-row steps.

Between the projections a layer runs a residual add and RMSNorm (twice), the rotary embedding with its
casts, and SwiGLU: eager, each op reads and writes the whole activation again (at 2048 rows about a
third of a prefill step on a 2-core CPU). Inductor fuses each group into one loop over the rows. A
compiled call costs ~40 us more than an eager one (guards, wrapper), more than the fusion saves below a
few hundred rows, so only steps of at least ``min_rows`` rows take the compiled functions, and the
float32 reference path (no narrowing casts) never does.

Inductor bakes the OpenMP thread count into a graph's loops, and dynamo guards on it: a step on another
count than the warm-up's compiles the three graphs again, in the step. The worker's thread rule moves
long steps to fewer threads while a core is taken (evenflow/worker/threads.py), so the warm-up compiles
for every count a step may run on (served on the real GGUF: the first fallback's first prefill step
compiled for 5.2 s while every stream waited).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from evenflow.worker.models.int4_linear import Int4CpuLinear
from evenflow.worker.models.layers import apply_rotary, rms_norm_narrowing
from evenflow.worker.models.linear import cpu_has_fast_path

if TYPE_CHECKING:
    from evenflow.worker.models.llama import LlamaModel

log = logging.getLogger("evenflow.worker.compiled_ops")

# Steps of fewer rows stay eager: below this the ~40 us a compiled call costs beyond an eager one
# outweighs what the fusion saves (SmolLM2's layers on a 2-core Xeon: docs/results/steadiness.md).
COMPILE_MIN_ROWS = 256


def add_norm(x: torch.Tensor, delta: torch.Tensor, scaled: torch.Tensor, eps_root: torch.Tensor,
             out_dtype: torch.dtype) -> torch.Tensor:
    """``x += delta`` (the residual stream, in place), then the narrowing RMSNorm of ``x``."""
    x.add_(delta)
    return rms_norm_narrowing(x, scaled, eps_root, out_dtype)


def rotary_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, qk_end: int, head_dim: int,
              kv_dtype: torch.dtype) -> torch.Tensor:
    """The q and k heads of a fused qkv output, rotated, in the KV cache's dtype: [tokens, heads, head_dim]."""
    qk = qkv[:, :qk_end].view(qkv.shape[0], -1, head_dim)
    return apply_rotary(qk, cos, sin).to(kv_dtype)


def swiglu(gu: torch.Tensor, inter: int, out_dtype: torch.dtype) -> torch.Tensor:
    """silu(gate) * up of a fused gate_up output, in the down projection's input dtype."""
    a = F.silu(gu[:, :inter]) * gu[:, inter:]
    return a if a.dtype == out_dtype else a.to(out_dtype)


class CompiledOps:
    """``add_norm``, ``rotary_qk`` and ``swiglu`` compiled for one model's widths and dtypes, and the row
    count from which a step uses them. The widths are constants of the graphs (symbolic widths stop
    inductor from vectorizing); the rows are symbolic, so one graph per function serves every step."""

    def __init__(self, min_rows: int, hidden: int, qkv_width: int, qk_end: int, head_dim: int, inter: int,
                 act_dtype: torch.dtype, kv_dtype: torch.dtype, rotary_dtype: torch.dtype,
                 qkv_dtype: torch.dtype | None = None) -> None:
        """``qkv_dtype``: the qkv projection's output dtype where it is not ``act_dtype`` (a float32 bias added
        to a bfloat16 product widens it), so that the warm-up compiles the graph the steps call."""
        self.min_rows = min_rows

        def add_norm_(x: torch.Tensor, delta: torch.Tensor, scaled: torch.Tensor, eps_root: torch.Tensor
                      ) -> torch.Tensor:
            return add_norm(x, delta, scaled, eps_root, act_dtype)

        def rotary_qk_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            return rotary_qk(qkv, cos, sin, qk_end, head_dim, kv_dtype)

        def swiglu_(gu: torch.Tensor) -> torch.Tensor:
            return swiglu(gu, inter, act_dtype)

        self.add_norm, self.rotary_qk, self.swiglu = (torch.compile(fn) for fn in (add_norm_, rotary_qk_, swiglu_))
        self._inputs = (hidden, qkv_width, head_dim, inter, act_dtype, rotary_dtype, qkv_dtype or act_dtype)

    def warm_up(self, thread_counts: Iterable[int] = ()) -> tuple[int, ...]:
        """Compile the three graphs (or load them from inductor's cache) with the rows symbolic, for each of
        ``thread_counts`` (default: the current count), so that no step of any row count on any of them
        compiles while requests wait; returns the counts compiled for."""
        current = torch.get_num_threads()
        counts = tuple(sorted(set(thread_counts))) or (current,)
        try:
            for count in counts:
                torch.set_num_threads(count)
                self._compile()
        finally:
            torch.set_num_threads(current)
        return counts

    def _compile(self) -> None:
        hidden, qkv_width, head_dim, inter, act, rotary_dtype, qkv_dtype = self._inputs
        rows = max(self.min_rows, 2)

        def rows_dynamic(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            t = torch.zeros(rows, *shape, dtype=dtype)
            torch._dynamo.mark_dynamic(t, 0)
            return t

        # As the model holds them: the weights are plain tensors, a step's activations inference tensors
        # (dynamo guards on which, and a mismatch would compile again at the first real step).
        scaled, eps_root = torch.ones(hidden), torch.tensor(1.0)
        with torch.inference_mode():
            self.add_norm(rows_dynamic(hidden, dtype=torch.float32), rows_dynamic(hidden, dtype=act), scaled, eps_root)
            self.rotary_qk(rows_dynamic(qkv_width, dtype=qkv_dtype), rows_dynamic(1, head_dim, dtype=rotary_dtype),
                           rows_dynamic(1, head_dim, dtype=rotary_dtype))
            self.swiglu(rows_dynamic(2 * inter, dtype=act))

    def takes(self, rows: int) -> bool:
        return rows >= self.min_rows


def off_narrowing_path(model: LlamaModel) -> str | None:
    """Why ``model`` does not run the narrowing path (a float32 residual stream into int4 projections, on one
    CPU process), or None where it does: the one gate of the fused elementwise groups, compiled and C++."""
    if not (isinstance(model.linear, Int4CpuLinear) and model.dtype == torch.float32 and model.device.type == "cpu"
            and not model.tp.enabled and model._linears):
        return "the model's dtype is its projections' dtype: nothing to fuse around them"
    return None


def compile_layer_ops(model: LlamaModel, min_rows: int, thread_counts: Iterable[int] = (),
                      bf16_native: bool | None = None) -> str:
    """Give ``model`` compiled elementwise groups for steps of ``min_rows`` rows or more (more than the int4
    plan's rows where those compute in another dtype) on any of ``thread_counts`` (default: the current
    count), where it runs the narrowing path: a float32 residual
    stream into bfloat16 projections (GGUF 4-bit weights on a CPU with native bfloat16). Returns what was
    done, for the start-up log. Graphs an earlier call gave are dropped first: they were for that call's plan.

    Without native bfloat16 (``bf16_native``: the CPU's, by default) nothing is compiled: the C++ layer glue
    takes those steps, and on a 2-core AVX2 EPYC the compiled groups were no faster than it at 256-2048 rows
    (a 2048-token prefill of SmolLM2's GGUF 4.08-4.45 s against 4.19-4.56 s) while their compile added 1.5 s
    to a start-up with a warm compile cache (docs/results/quantization.md)."""
    model.compiled_ops = None
    off = off_narrowing_path(model)
    if off is not None:
        return f"eager ({off})"
    if not (cpu_has_fast_path(torch.bfloat16) if bf16_native is None else bf16_native):
        return "eager (no native bfloat16 here: the C++ layer glue takes the steps, without a compile)"
    linear, w = model.linear, model._linears[0]
    assert isinstance(linear, Int4CpuLinear)
    plan = linear.plan
    if not plan.every_row and plan.act_dtype(min_rows) != plan.act_dtype(max(min_rows, plan.max_int4_rows + 1)):
        min_rows = plan.max_int4_rows + 1  # the graphs take one activation dtype: the dense path's, above int4's rows
    act = linear.act_dtype(w.qkv, min_rows)
    if act == torch.float32 or any(linear.act_dtype(p, min_rows) != act for p in (w.o, w.gate_up, w.down)):
        return f"eager ({min_rows}-row steps compute in float32: no narrowing casts to fuse)"
    cfg = model.cfg
    qk_end = model.q_size + model.kv_size
    qkv_dtype = act if w.qkv_bias is None else torch.promote_types(act, w.qkv_bias.dtype)
    ops = CompiledOps(min_rows, cfg.hidden_size, qk_end + model.kv_size, qk_end, cfg.head_dim, model.intermediate,
                      act, model.kv_dtype, model.rotary.cos.dtype, qkv_dtype)
    previous = inductor_config.compile_threads
    inductor_config.compile_threads = 1  # no pool of compile processes left beside the worker
    start = time.perf_counter()
    try:
        counts = ops.warm_up(thread_counts)
    except Exception as e:  # no C++ compiler, an inductor limit: the eager ops are the same math
        log.warning("elementwise ops stay eager: torch.compile failed (%s: %s)", type(e).__name__, e)
        return "eager (torch.compile failed)"
    finally:
        inductor_config.compile_threads = previous
    model.compiled_ops = ops
    seconds = time.perf_counter() - start
    return f"compiled for steps of {min_rows}+ rows on {'/'.join(map(str, counts))} threads in {seconds:.1f} s"
