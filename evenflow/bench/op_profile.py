"""One decode step by op class: torch.profiler over synthetic decode steps, the attention backend,
the LM head, the sampler and the fused layer loop (models/fused_decode.py: every layer of a step it
takes, its projections among them) each as a whole, every other top-level aten op put in a class by name
(int4 linears, dense linears, norms, rotary, casts, elementwise, views), and the step's wall time
less all of them as "Python and dispatch" (the interpreter between ops, and the C++ layer glue of
models/layer_glue.py, whose ctypes calls are no aten ops: a label of its own, one ``record_function`` a
call, cost several times what the calls do).

The profiler adds ~1 us an op, so its absolute figures run above an unprofiled step; the split is
what it is for (evenflow/bench/roofline.py times the unprofiled step).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from evenflow.worker.runner import ModelRunner
from evenflow.worker.sampling_metadata import SamplingMetadata
from evenflow.worker.synthetic_steps import synthetic_step

# The attention backend, the LM head, the sampler and the fused layer loop are labelled as a whole
# (record_function); every other top-level aten op is put in a class by its name.
LABELLED = ("attention", "LM head", "sampling", "fused layers")
CLASSES: dict[str, tuple[str, ...]] = {
    "int4 linears": ("aten::_weight_int4pack_mm_for_cpu",),
    "dense linears": ("mkldnn::_linear_pointwise", "aten::linear", "aten::addmm", "aten::mm", "aten::matmul"),
    "norms": ("aten::rms_norm", "aten::_fused_rms_norm"),
    "rotary": ("aten::flip", "aten::addcmul"),
    "casts": ("aten::to", "aten::_to_copy", "aten::copy_", "aten::type_as"),
    "elementwise": ("aten::add", "aten::add_", "aten::mul", "aten::mul_", "aten::sub", "aten::silu", "aten::silu_"),
    "views": ("aten::view", "aten::slice", "aten::reshape", "aten::transpose", "aten::unsqueeze", "aten::select",
              "aten::alias", "aten::expand", "aten::as_strided", "aten::t"),
}
_CLASS_OF = {op: cls for cls, ops in CLASSES.items() for op in ops} | {label: label for label in LABELLED}


class _Labelled:
    """Calls ``fn`` inside a profiler label; other attributes pass through to it."""

    def __init__(self, fn, label: str) -> None:
        self.fn, self.label = fn, label

    def __getattr__(self, name: str):
        return getattr(self.fn, name)

    def __call__(self, *args, **kwargs):
        with record_function(self.label):
            return self.fn(*args, **kwargs)


@dataclass(frozen=True)
class OpSplit:
    wall_ms: float  # the profiled step
    classes: dict[str, tuple[float, int]]  # class -> (ms a step, op calls a step)

    @property
    def dispatch_ms(self) -> float:
        return max(self.wall_ms - sum(ms for ms, _ in self.classes.values()), 0.0)


def op_split(runner: ModelRunner, batch: int, context: int, steps: int = 10) -> OpSplit:
    """Mean per step over ``steps`` profiled greedy decode steps (after two warm-up steps)."""
    step = synthetic_step([1] * batch, [context] * batch, runner.block_size, runner.device)
    caches = runner._scratch_caches(step.num_blocks)
    model = runner.model
    meta = SamplingMetadata(num_reqs=batch, vocab_size=runner.vocab_size)
    attn = runner.attn
    sampler = _Labelled(runner.sampler, "sampling")
    head_kernel, screened = model.head_linear, model._screened_head

    class _Attention:
        forward = _Labelled(attn.forward, "attention")
        plan = attn.plan
        scale = attn.scale

    def one() -> None:
        logits = model(step.input_ids, step.positions, caches, _Attention, attn.plan(step.attn), step.logits_indices,
                       greedy=True)
        sampler(logits, meta).sampled_token_ids.tolist()

    if screened is None:
        model.head_linear = _Labelled(head_kernel, "LM head")
    else:
        model._screened_head = _Labelled(screened, "LM head")
    fused = model.fused_decode
    if fused is not None:
        model.fused_decode = _Labelled(fused, "fused layers")
    try:
        with torch.inference_mode():
            one()
            one()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                t0 = time.perf_counter()
                for _ in range(steps):
                    one()
                wall = time.perf_counter() - t0
    finally:
        model.head_linear, model._screened_head, model.fused_decode = head_kernel, screened, fused
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.cpu_parent is not None:
            continue
        acc = sums[_CLASS_OF.get(event.name, "other ops")]
        acc[0] += event.cpu_time_total / 1e3
        acc[1] += 1
    classes = {cls: (ms / steps, round(n / steps)) for cls, (ms, n) in sums.items()}
    return OpSplit(wall * 1e3 / steps, classes)


def format_op_table(splits: dict[str, OpSplit]) -> str:
    """Columns: one per label (mode, threads); rows: op classes, ms a step (op calls a step)."""
    labels = list(splits)
    names = [c for c in [*CLASSES, *LABELLED, "other ops"] if any(c in s.classes for s in splits.values())]
    lines = ["| op class | " + " | ".join(labels) + " |", "|---|" + "--:|" * len(labels)]
    for name in names:
        cells = [f"{s.classes[name][0]:.2f} ({s.classes[name][1]})" if name in s.classes else "-"
                 for s in splits.values()]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("| Python and dispatch | " + " | ".join(f"{s.dispatch_ms:.2f}" for s in splits.values()) + " |")
    lines.append("| **step (profiled)** | " + " | ".join(f"**{s.wall_ms:.2f}**" for s in splits.values()) + " |")
    return "\n".join(lines)
